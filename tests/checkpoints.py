"""Realistic checkpoints written for tests: safetensors files, HF folders, torch DCP."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def state_dict(seed: int = 0, layers: int = 4, width: int = 64, dtype=torch.float32) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """A small decoder-like layout: embedding, per-layer attention/MLP weights, biases, norms."""
    g = torch.Generator().manual_seed(seed)
    sd = {"embed.weight": torch.randn(256, width, generator=g).to(dtype)}
    for i in range(layers):
        p = f"layers.{i}"
        for name in ("q", "k", "v", "o"):
            sd[f"{p}.attn.{name}.weight"] = torch.randn(width, width, generator=g).to(dtype)
        sd[f"{p}.mlp.up.weight"] = torch.randn(4 * width, width, generator=g).to(dtype)
        sd[f"{p}.mlp.up.bias"] = torch.randn(4 * width, generator=g).to(dtype)
        sd[f"{p}.mlp.down.weight"] = torch.randn(width, 4 * width, generator=g).to(dtype)
        sd[f"{p}.norm.weight"] = torch.ones(width, dtype=dtype)
    sd["lm_head.weight"] = torch.randn(256, width, generator=g).to(dtype)
    return sd


def atomic_save(sd: dict[str, torch.Tensor], path: Path) -> Path:
    """Write like a careful trainer: temporary name, then rename into place."""
    tmp = path.parent / f".{path.name}.tmp"
    save_file(sd, str(tmp))
    os.rename(tmp, path)
    return path


def hf_folder(path: Path, seed: int = 0, parts: int = 3) -> Path:
    """An HF-style directory: several safetensors files, their index, config and trainer files."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.mkdir()
    sd = state_dict(seed, layers=6)
    names = sorted(sd)
    weight_map = {}
    for k in range(parts):
        fname = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: sd[n] for n in names[k::parts]}
        save_file(chunk, str(tmp / fname))
        weight_map.update({n: fname for n in chunk})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 64}))
    torch.save({"step": 10, "lr": 0.1}, tmp / "optimizer.pt")
    torch.save({"output_dir": "out"}, tmp / "training_args.bin")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    os.rename(tmp, path)
    return path


def dcp_folder(path: Path, seed: int = 0) -> Path:
    """A torch.distributed.checkpoint directory (.distcp files and .metadata)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    tmp = path.parent / f".{path.name}.tmp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict(seed), checkpoint_id=str(tmp))
    os.rename(tmp, path)
    return path


def files_of(path: Path) -> dict[str, bytes]:
    """Relative path -> content, for byte-for-byte comparison."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
