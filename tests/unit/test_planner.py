"""The shard planner: balance, determinism, every tensor exactly once, valid shards."""
from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load, save

from pipeline.header import Header, TensorInfo, parse_header
from pipeline.planner import group_tensors, plan_opaque, plan_safetensors


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
