"""Realistic checkpoints written for tests: safetensors files, HF folders, torch DCP."""
from __future__ import annotations

from pathlib import Path

import torch

from bench import layouts


def state_dict(seed: int = 0, layers: int = 4, width: int = 64, dtype=torch.float32) -> dict[str, torch.Tensor]:
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
    return layouts.write_file(sd, path)


def hf_folder(path: Path, seed: int = 0, parts: int = 3) -> Path:
    """An HF Trainer folder: several safetensors files, their index, config and trainer files."""
    return layouts.write_hf(state_dict(seed, layers=6), path, parts=parts, trainer=True)


def dcp_folder(path: Path, seed: int = 0) -> Path:
    """A torch.distributed.checkpoint directory (.distcp files and .metadata)."""
    return layouts.write_dcp(state_dict(seed), path)


def files_of(path: Path) -> dict[str, bytes]:
    """Relative path -> content, for byte-for-byte comparison."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
