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


def restore_limit_seconds(copies: list[Path], scratch: Path) -> float:
    """Read one copy of every shard, hash it and write it into one file with fsync: what a
    restore must do at least.

    ``copies`` are the replica files themselves, read from the disk rather than the page
    cache: replicas on a storage worker are cold (their worker re-read them with the cache
    dropped when it verified them), and a just-written file would not be (the VM's disk
    reads recently written blocks several times faster than old ones).
    """
    scratch.mkdir(parents=True, exist_ok=True)
    for c in copies:
        drop_cache(c)
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(scratch / "restored", "wb", buffering=0) as out:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        for c in copies:
            with open(c, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    h.update(view[:n])
                    out.write(view[:n])
        os.fsync(out.fileno())
    seconds = time.perf_counter() - t
    os.unlink(scratch / "restored")
    return seconds


def drop_cache(path: Path) -> None:
    """Write back and evict ``path``'s pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def flush(path: Path) -> None:
    """fsync a freshly generated checkpoint, so that its write-back does not run under
    whatever is measured next (4 GiB of dirty pages slow every write on the disk for
    tens of seconds and made the first measurement after them look up to 2x slower)."""
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
