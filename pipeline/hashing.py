"""Hashing files in one sequential pass with a reused buffer.

:func:`scan` reads a file once and produces both its whole-file SHA-256 and the
SHA-256 of every planned shard (a safetensors shard's hash covers its own header first),
so the manifest costs one read of the source.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from pipeline.core.planner import ShardPlan

BLOCK = 4 * 1024 * 1024


_SIDE: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def side_thread(name: str = "ckpt-hash") -> ThreadPoolExecutor:
    """One helper thread of that name per process (a forked child starts its own: threads
    do not fork)."""
    held = _SIDE.get(name)
    if held is None or held[0] != os.getpid():
        held = _SIDE[name] = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix=name))
    return held[1]


def scan(
    path: str | os.PathLike[str],
    plans: Sequence[ShardPlan],
    *,
    expected_size: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_shard: Callable[[ShardPlan, str], None] | None = None,
) -> tuple[str, list[str]]:
    """Return ``(file_sha256, [shard_sha256, ...])`` from a single read of ``path``.

    ``plans`` must cover the file contiguously in order (the planner guarantees it);
    ``on_shard`` is told each shard's SHA-256 as soon as it is known (detection starts its
    upload then: pipeline.store.early). Raises ``OSError`` if the file is shorter than the
    plans say.
    """
    whole = hashlib.sha256()
    shard_hashes: list[str] = []
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    # hashlib releases the GIL on large buffers: the whole-file hash runs on a second core
    # while this thread hashes the same block into its shard.
    side = side_thread()
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        size = os.fstat(f.fileno()).st_size
        if expected_size is not None and size != expected_size:
            raise OSError(f"{path}: size is {size}, expected {expected_size}")
        pos = 0
        for plan in plans:
            if plan.src_offset != pos:
                raise ValueError(f"shard {plan.seq} starts at {plan.src_offset}, expected {pos}")
            h = hashlib.sha256(plan.header)
            remaining = plan.length
            while remaining:
                n = f.readinto(view[: min(BLOCK, remaining)])
                if not n:
                    raise OSError(f"{path}: file ended at byte {pos} while shard {plan.seq} needs more")
                chunk = view[:n]
                pending = side.submit(whole.update, chunk)
                h.update(chunk)
                pending.result()
                remaining -= n
                pos += n
                if progress:
                    progress(n)
            shard_hashes.append(h.hexdigest())
            if on_shard:
                on_shard(plan, shard_hashes[-1])
        if f.read(1):
            raise OSError(f"{path}: file is longer than its shard plan ({pos} bytes)")
    return whole.hexdigest(), shard_hashes
