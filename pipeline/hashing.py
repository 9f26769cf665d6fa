"""Hashing a file and its planned shards (a safetensors shard's hash covers its own header first).

:func:`scan` reads a file once, in order, for its whole-file SHA-256 and every shard's.
:func:`scan_from_two_places` (detection) gives the same answer with the shards hashed from the
file's start and its middle at once, so that a changed shard of either half is known early
(deduplication sends only those); its whole-file hash reads the file a second time, from the
page cache, and a file too large for that is scanned once in order instead.
"""
from __future__ import annotations

import hashlib
import os
import threading
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


#: A file is hashed from two places at once when it is at most this share of the memory the
#: kernel says is available: its whole-file hash then reads it a second time from the page
#: cache. A larger file is read once, in order (:func:`scan`).
CACHE_SHARE = 0.25
#: A file smaller than this is read once, in order, on the caller's thread (:func:`scan`): it
#: is hashed in a few milliseconds, less than starting the three threads of two places costs
#: (a save every tenth of a second spent more time starting threads than hashing).
TWO_PLACES_MIN_BYTES = 16 * 1024 * 1024


def available_memory() -> int:
    """Bytes the kernel says are available (MemAvailable), or 0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def scan_from_two_places(
    path: str | os.PathLike[str],
    plans: Sequence[ShardPlan],
    *,
    expected_size: int | None = None,
    on_shard: Callable[[ShardPlan, str], None] | None = None,
) -> tuple[str, list[str]]:
    """:func:`scan`'s answer, with the shards' SHA-256 found from the file's start and its
    middle at once and the whole-file SHA-256 by a third reader in order.

    Deduplication sends only the shards that changed, and a shard is known to have changed
    only once it is hashed: a step whose first half did not change (frozen lower layers) sent
    nothing while that half was hashed in order. From two places, the first changed shard of
    either half is found in the time of one shard. ``on_shard`` is told each shard as it is
    found (one call at a time, in the order they are found). The CPU work is the same (two
    hashes per byte); the second read comes from the page cache, which is why a file larger
    than ``CACHE_SHARE`` of the available memory is read once, in order, instead, and so is one
    smaller than ``TWO_PLACES_MIN_BYTES``.
    """
    size = os.stat(path).st_size
    if expected_size is not None and size != expected_size:
        raise OSError(f"{path}: size is {size}, expected {expected_size}")
    if len(plans) < 2 or size < TWO_PLACES_MIN_BYTES or size > CACHE_SHARE * available_memory():
        return scan(path, plans, expected_size=expected_size, on_shard=on_shard)
    pos = 0
    for p in plans:
        if p.src_offset != pos:
            raise ValueError(f"shard {p.seq} starts at {p.src_offset}, expected {pos}")
        pos += p.length
    if pos != size:
        raise OSError(f"{path}: file is {size} bytes and its shard plan covers {pos}")
    middle = next(i for i, p in enumerate(plans) if p.src_offset + p.length >= size / 2) + 1
    middle = min(middle, len(plans) - 1)
    found: list[str] = [""] * len(plans)
    told = threading.Lock()

    def region(first: int, end: int) -> None:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            fd = f.fileno()
            os.posix_fadvise(fd, plans[first].src_offset, 0, os.POSIX_FADV_SEQUENTIAL)
            for i in range(first, end):
                plan = plans[i]
                h = hashlib.sha256(plan.header)
                at, left = plan.src_offset, plan.length
                while left:
                    n = os.preadv(fd, [view[: min(BLOCK, left)]], at)
                    if not n:
                        raise OSError(f"{path}: file ended at byte {at} while shard {plan.seq} needs more")
                    h.update(view[:n])
                    at, left = at + n, left - n
                found[i] = h.hexdigest()
                if on_shard:
                    with told:
                        on_shard(plan, found[i])

    def whole() -> str:
        h = hashlib.sha256()
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            read = 0
            while n := f.readinto(view):
                h.update(view[:n])
                read += n
        if read != size:
            raise OSError(f"{path}: read {read} bytes of {size}")
        return h.hexdigest()

    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="ckpt-scan") as pool:
        parts = [pool.submit(region, 0, middle), pool.submit(region, middle, len(plans))]
        file_sha = pool.submit(whole)
        for part in parts:
            part.result()
        return file_sha.result(), found
