"""This machine's physical limits, measured in the same run as the pipeline."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

BLOCK = 4 * 1024 * 1024


def sha256_seconds(path: Path) -> tuple[float, str]:
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return time.perf_counter() - t, h.hexdigest()


def write_copies_seconds(src: Path, scratch: Path, copies: int) -> float:
    """Write ``copies`` copies of ``src`` with fsync on the same disk (what RF replicas cost)."""
    scratch.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for i in range(copies):
        with open(src, "rb", buffering=0) as f, open(scratch / f"copy{i}", "wb", buffering=0) as out:
            buf = bytearray(BLOCK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                out.write(view[:n])
            os.fsync(out.fileno())
    seconds = time.perf_counter() - t
    for i in range(copies):
        os.unlink(scratch / f"copy{i}")
    return seconds


def restore_limit_seconds(src: Path, scratch: Path) -> float:
    """Read one copy, hash it and write it with fsync: what a restore must do at least."""
    scratch.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(src, "rb", buffering=0) as f, open(scratch / "restored", "wb", buffering=0) as out:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            out.write(view[:n])
        os.fsync(out.fileno())
    seconds = time.perf_counter() - t
    os.unlink(scratch / "restored")
    return seconds
