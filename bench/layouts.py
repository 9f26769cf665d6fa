"""Realistic checkpoints written by the benchmark itself (no downloads).

A decoder-only transformer in bf16: embedding, per-layer attention and MLP weights with
biases and norms, final norm and LM head — a few hundred tensors of very different sizes,
scaled by width and depth to a target byte size.
"""
from __future__ import annotations

import json
import os
import warnings
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

GiB = 1024**3


def shape_for(target_bytes: int) -> tuple[int, int, int]:
    """(hidden, layers, vocab) whose bf16 decoder is about ``target_bytes``."""
    vocab = 32000
    for hidden in (512, 768, 1024, 1536, 2048, 2560, 3072, 4096):
        per_layer = 2 * (4 * hidden * hidden + 3 * hidden * 4 * hidden)  # bf16 bytes
        embed = 2 * 2 * vocab * hidden
        layers = max(2, round((target_bytes - embed) / per_layer))
        if layers <= 40:
            return hidden, layers, vocab
    return 4096, max(2, round(target_bytes / (2 * 16 * 4096 * 4096))), vocab


def decoder(target_bytes: int, seed: int = 0, changed_from_layer: int | None = None,
            base_seed: int | None = None, *, normal: bool = False) -> dict[str, torch.Tensor]:
    """A decoder state dict; with ``changed_from_layer``, layers below it (and the embedding)
    are those of ``base_seed`` and the rest are new: a fine-tuning step on a frozen trunk.
    ``normal``: weights drawn from N(0, 0.02) as a model's initialisation (the exponent bytes
    of real weights: zstd shrinks them to 0.78, as it does a small Qwen2 trained a few
    steps); otherwise uniform in (-0.5, 0.5), as the benchmark has always used."""
    hidden, layers, vocab = shape_for(target_bytes)

    def rand(name: str, *shape: int) -> torch.Tensor:
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else (-1 if "embed" in name else layers)
        s = seed if changed_from_layer is None or layer >= changed_from_layer else base_seed
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 7919 + s)
        if normal:
            return (torch.randn(*shape, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        return (torch.rand(*shape, generator=g, dtype=torch.float32) - 0.5).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": rand("model.embed_tokens.weight", vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}.self_attn.{n}.weight"] = rand(f"{p}.self_attn.{n}.weight", hidden, hidden)
            sd[f"{p}.self_attn.{n}.bias"] = rand(f"{p}.self_attn.{n}.bias", hidden)
        sd[f"{p}.mlp.gate_proj.weight"] = rand(f"{p}.mlp.gate_proj.weight", 4 * hidden, hidden)
        sd[f"{p}.mlp.up_proj.weight"] = rand(f"{p}.mlp.up_proj.weight", 4 * hidden, hidden)
        sd[f"{p}.mlp.down_proj.weight"] = rand(f"{p}.mlp.down_proj.weight", hidden, 4 * hidden)
        sd[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["lm_head.weight"] = rand("lm_head.weight", vocab, hidden)
    return sd


def write_file(sd: dict[str, torch.Tensor], path: Path) -> Path:
    """Write like a careful trainer: a temporary name, then a rename into place."""
    tmp = path.parent / f".{path.name}.tmp"
    save_file(sd, str(tmp))
    os.rename(tmp, path)
    return path


def write_hf(sd: dict[str, torch.Tensor], path: Path, parts: int = 4, trainer: bool = False) -> Path:
    """An HF-style folder: ``parts`` safetensors files, their index and a config; with
    ``trainer``, also the HF Trainer's optimizer, training args and (last) trainer state."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.mkdir()
    names = sorted(sd)
    weight_map = {}
    for k in range(parts):
        fname = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: sd[n] for n in names[k::parts]}
        save_file(chunk, str(tmp / fname))
        weight_map.update({n: fname for n in chunk})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if trainer:
        torch.save({"step": 10, "lr": 0.1}, tmp / "optimizer.pt")
        torch.save({"output_dir": "out"}, tmp / "training_args.bin")
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    os.rename(tmp, path)
    return path


def write_dcp(sd: dict[str, torch.Tensor], path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    tmp = path.parent / f".{path.name}.tmp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp))
    os.rename(tmp, path)
    return path


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
