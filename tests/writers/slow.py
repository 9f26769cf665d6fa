"""A slow disk for real checkpoint writers, installed in the writer's own process.

Every file a writer opens for writing under ``CKPT_SLOW_ROOT`` goes through :class:`SlowFile`:
before a weights file it waits ``CKPT_SLOW_BEFORE`` seconds (what gathering and serializing
a multi-GB shard costs), and inside every file it waits ``CKPT_SLOW_INSIDE`` seconds once half
of a write is on the disk (a slow disk, or a writer that pauses mid-file). The libraries'
own writers that bypass Python's ``open`` (safetensors' Rust writer, torch.save's C++ file
writer) are routed through it with the same bytes: ``safetensors.torch.save`` and
``torch.save`` into the opened file. Import this module before the library that writes.
"""
from __future__ import annotations

import builtins
import io
import os
import sys
import time
from typing import Any

ROOT = os.environ.get("CKPT_SLOW_ROOT", "")
BEFORE = float(os.environ.get("CKPT_SLOW_BEFORE", "0"))
INSIDE = float(os.environ.get("CKPT_SLOW_INSIDE", "0"))
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".pkl")
_real_open = builtins.open


class SlowFile:
    """A file whose writes pause once, halfway through the first large write."""

    def __init__(self, f: Any) -> None:
        self._f, self._paused = f, False

    def write(self, data: Any) -> int:
        if not self._paused and INSIDE and len(data) > 64:
            half = len(data) // 2
            if not isinstance(data, str):
                data = memoryview(data).cast("B")
            self._f.write(data[:half])
            self._f.flush()
            os.fsync(self._f.fileno())
            self._paused = True
            time.sleep(INSIDE)
            self._f.write(data[half:])
            return len(data)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> SlowFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __iter__(self) -> Any:
        return iter(self._f)


def _watched(file: Any) -> bool:
    try:
        path = os.path.abspath(os.fspath(file))
    except TypeError:
        return False
    return bool(ROOT) and path.startswith(ROOT)


def slow_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    writing = any(c in mode for c in "wax")
    if writing and _watched(file):
        name = os.path.basename(os.fspath(file))
        if BEFORE and name.endswith(WEIGHTS):
            time.sleep(BEFORE)
        return SlowFile(_real_open(file, mode, *args, **kwargs))
    return _real_open(file, mode, *args, **kwargs)


def install() -> None:
    if not ROOT:
        return
    builtins.open = slow_open
    io.open = slow_open

    import safetensors.torch
    import torch

    def save_file(tensors: Any, filename: Any, metadata: Any = None) -> None:
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data)

    real_save_file, safetensors.torch.save_file = safetensors.torch.save_file, save_file
    real_save = torch.save

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)) and _watched(f):
            with open(f, "wb") as out:
                buffer = io.BytesIO()
                real_save(obj, buffer, *args, **kwargs)
                out.write(buffer.getbuffer())
            return
        real_save(obj, f, *args, **kwargs)

    torch.save = torch_save
    _rebind({id(real_save_file): save_file, id(real_save): torch_save})


def _rebind(replacements: dict[int, Any]) -> None:
    """Point every name another module bound to a replaced function at its replacement. A
    trainer forked from a preloaded process (tests/writers/forkserver.py) imported transformers
    and accelerate before this module, and they hold safetensors' ``save_file`` under their own
    names (``from safetensors.torch import save_file as safe_save_file``); in a fresh process
    they are imported later and bind the replacement, and this finds nothing to change."""
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("torch", "safetensors") or not hasattr(module, "__dict__"):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in replacements:
                setattr(module, attr, replacements[id(value)])


install()
