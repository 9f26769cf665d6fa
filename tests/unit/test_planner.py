"""The shard planner: balance, determinism, every tensor exactly once, valid shards."""
from __future__ import annotations

import math
import random

import pytest
import torch
from safetensors.torch import load, save

from pipeline.core.header import Header, TensorInfo, parse_header
from pipeline.core.planner import (
    group_tensors,
    module_key,
    module_units,
    plan_opaque,
    plan_safetensors,
)


def layout(sizes: list[int]) -> Header:
    tensors, pos = [], 0
    for i, n in enumerate(sizes):
        tensors.append(TensorInfo(f"t{i}", "U8", (n,), pos, pos + n))
        pos += n
    return Header(json_len=0, file_size=8 + pos, tensors=tuple(tensors), metadata=None)


@pytest.mark.parametrize("seed", range(20))
def test_every_tensor_lands_in_exactly_one_shard_in_order(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 10, 1000, 50_000, 300_000]) for _ in range(rng.randint(1, 200))]
    h = layout(sizes)
    plans = plan_safetensors(h, target=rng.choice([1000, 64_000, 1_000_000]))
    names = [n for p in plans for n in p.tensors]
    assert names == [t.name for t in h.tensors]
    pos = 0
    for p in plans:  # contiguous cover of the whole file
        assert p.src_offset == pos
        pos += p.length
    assert pos == h.file_size


def test_shards_are_byte_balanced():
    h = layout([1000] * 100)  # 100 kB of equal tensors
    plans = plan_safetensors(h, target=30_000)[1:]
    assert len(plans) == 4
    lengths = [p.length for p in plans]
    assert max(lengths) - min(lengths) <= 1000


def test_a_tensor_bigger_than_the_target_gets_its_own_shard():
    h = layout([10, 10, 1_000_000, 10])
    groups = group_tensors(h.tensors, target=1000)
    assert any(g == (h.tensors[2],) for g in groups)


def test_plan_is_deterministic_and_ignores_tensor_values():
    a = save({f"w{i}": torch.randn(100 + i) for i in range(50)})
    b = save({f"w{i}": torch.randn(100 + i) for i in range(50)})  # same layout, new values
    pa = plan_safetensors(parse_header(a, len(a)), 4096)
    pb = plan_safetensors(parse_header(b, len(b)), 4096)
    assert pa == pb
    assert plan_safetensors(parse_header(a, len(a)), 4096) == pa


def test_each_safetensors_shard_is_a_loadable_safetensors_file():
    sd = {f"w{i}": torch.randn(37, i + 1) for i in range(30)}
    blob = save(sd)
    plans = plan_safetensors(parse_header(blob, len(blob)), 2000)
    seen = {}
    for p in plans[1:]:
        shard = p.header + blob[p.src_offset : p.src_offset + p.length]
        seen.update(load(shard))
    assert set(seen) == set(sd) and all(torch.equal(seen[k], sd[k]) for k in sd)


def test_header_shard_holds_the_original_header_bytes():
    blob = save({"a": torch.zeros(3)}, metadata={"format": "pt"})
    h = parse_header(blob, len(blob))
    first = plan_safetensors(h, 1 << 20)[0]
    assert (first.kind, first.src_offset, first.length) == ("raw", 0, h.data_start)


@pytest.mark.parametrize("size,target,expected", [(0, 10, [0]), (10, 10, [10]), (25, 10, [10, 10, 5])])
def test_opaque_files_are_cut_in_fixed_chunks(size, target, expected):
    assert [p.length for p in plan_opaque(size, target)] == expected


@pytest.mark.parametrize("name,key", [
    ("model.layers.7.mlp.up_proj.weight", "model.layers.7"),
    ("model.layers.7", "model.layers.7"),
    ("encoder.block.0.layer.1.weight", "encoder.block.0"),
    ("lm_head.weight", "lm_head"),
    ("model.embed_tokens.weight", "model.embed_tokens"),
    ("w0", "w0"),
])
def test_module_key(name, key):
    assert module_key(name) == key


def decoder_layout(layers: int, hidden: int) -> Header:
    """A bf16 decoder's layout in the order safetensors writes it (sorted names)."""
    shapes = {"lm_head.weight": (32000, hidden), "model.embed_tokens.weight": (32000, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            shapes[f"model.layers.{i}.self_attn.{n}_proj.weight"] = (hidden, hidden)
            shapes[f"model.layers.{i}.self_attn.{n}_proj.bias"] = (hidden,)
        for n, shape in (("gate", (4 * hidden, hidden)), ("up", (4 * hidden, hidden)), ("down", (hidden, 4 * hidden))):
            shapes[f"model.layers.{i}.mlp.{n}_proj.weight"] = shape
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
    tensors, pos = [], 0
    for name in sorted(shapes):
        n = 2 * math.prod(shapes[name])
        tensors.append(TensorInfo(name, "BF16", shapes[name], pos, pos + n))
        pos += n
    return Header(json_len=0, file_size=8 + pos, tensors=tuple(tensors), metadata=None)


@pytest.mark.parametrize("layers,hidden", [(28, 1024), (6, 2048), (40, 512), (5, 512)])
def test_a_shard_never_mixes_a_large_block_with_another(layers, hidden):
    target = 64 * 1024 * 1024
    for group in group_tensors(decoder_layout(layers, hidden).tensors, target):
        units = module_units(group)
        sizes = [u[-1].end - u[0].begin for u in units]
        assert len(units) == 1 or all(8 * s < target for s in sizes), [module_key(u[0].name) for u in units]


def test_freezing_half_the_blocks_leaves_their_shards_unchanged():
    """A fine-tuning step that trains blocks 14-27 and the head of a 28-block decoder: the
    shards holding any trained tensor are about half of the bytes, not more."""
    h = decoder_layout(28, 1024)
    trained = {t.name for t in h.tensors
               if t.name.startswith("lm_head") or (t.name.startswith("model.layers.")
                                                   and int(t.name.split(".")[2]) >= 14)}
    groups = group_tensors(h.tensors, 64 * 1024 * 1024)
    resent = sum(g[-1].end - g[0].begin for g in groups if any(t.name in trained for t in g))
    changed = sum(t.nbytes for t in h.tensors if t.name in trained)
    assert resent == changed


def test_small_blocks_are_packed_together():
    h = decoder_layout(100, 64)  # 100 blocks of ~100 kB
    groups = group_tensors(h.tensors, 4 * 1024 * 1024)
    assert len(groups) <= 6


def test_a_small_decoder_gets_one_shard_per_block():
    """0.1 GiB: 8 MiB blocks with a 64 MiB target. Packing them would make a step that trains
    the top blocks re-send the frozen ones too."""
    h = decoder_layout(5, 512)
    layer_groups = [g for g in group_tensors(h.tensors, 64 * 1024 * 1024) if g[0].name.startswith("model.layers.")]
    assert [module_key(g[0].name) for g in layer_groups] == [f"model.layers.{i}" for i in range(5)]
    assert all(len(module_units(g)) == 1 for g in layer_groups)
