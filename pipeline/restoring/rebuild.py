"""Rebuilding one file from its shards, checked against the file's SHA-256 (docs/design.md, invariants 2 and 4).

Up to ``STREAMS`` shards of a file arrive at once, each from the copy whose worker's link is
least busy (pipeline/restoring/links.py), and each is written at its offset as it arrives: a
restore reads from every worker holding the file at once, so the host's link fills even where
each worker's link (or disk) is slower. The file's SHA-256 is taken in file order behind
them, over each shard once it is complete (read back before its pages are written out and
dropped), and must equal the one recorded at detection before the file counts. A mismatch
makes a second pass that checks every shard's own SHA-256, finding the replica that sent bad
bytes and reading that shard from another. A shard no worker can send comes from an object
store (pipeline.restoring.gather: the source of last resort), into the same file through the
same checks; ``tally`` records which tier each shard was read from.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pipeline import failpoints
from pipeline.cluster.wire import is_loopback
from pipeline.durable import WriteBehind
from pipeline.errors import HashMismatch, RestoreError
from pipeline.restoring.gather import BLOCK, FileSource, ShardSource, Tally, fetch, on_store

if TYPE_CHECKING:
    from pipeline.settings import Settings

log = logging.getLogger("ckpt.restore")
#: Called with the bytes written since the last call (negative: bytes taken back).
Progress = Callable[[int], None]
#: Shards of one file fetched at once (each holds IN_FLIGHT blocks of gather.BLOCK), at most
#: one per worker holding them.
STREAMS = 4
#: ... when every copy is on this host (``ckpt up``): they share one disk and the two cores,
#: where four streams read the 1 GiB restore 40 % slower than two (5.6-5.7 s against 3.4-4.2 s).
LOCAL_STREAMS = 2


class _Written:
    """The bytes written so far, reported to ``progress`` from any thread."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.total = progress, 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.total += n
            if self.progress:
                self.progress(n)


def write_file(f: FileSource, out: Path | str, key: bytes, progress: Progress | None = None, *, wire: str = "off",
               dir_fd: int | None = None, settings: Settings | None = None,
               tally: Tally | None = None) -> os.stat_result:
    """Rebuild one file at ``out`` from its shards; raise unless it matches its SHA-256.

    ``dir_fd``: ``out`` is a name in that open directory (the restore's staging directory,
    written through its descriptor: docs/design.md, invariant 7). Returns the file's
    ``fstat`` as created, so the caller can tell it from anything put at its name later.

    The file's SHA-256 covers every byte written, so the shards are not also hashed one by
    one (that hashed every byte twice, and was the restore's bottleneck on two cores). If
    the file does not match, it is rebuilt once more checking every shard's SHA-256, which
    finds the replica that sent bad bytes and reads that shard from another.
    """
    how = _How(key, wire, settings, tally or Tally())
    try:
        return _write_file(f, out, how, progress, check=False, dir_fd=dir_fd)
    except HashMismatch as exc:
        log.warning("%s; rebuilding it checking every shard, to skip the bad copy", exc)
        os.unlink(out, dir_fd=dir_fd)
        return _write_file(f, out, how, progress, check=True, dir_fd=dir_fd)


@dataclass(frozen=True)
class _How:
    """How a file's shards are fetched: the cluster key, the wire setting, the settings whose
    targets an object-store copy is read through, the tally of where each came from."""

    key: bytes
    wire: str
    settings: Settings | None
    tally: Tally


def _write_file(f: FileSource, out: Path | str, how: _How, progress: Progress | None, *, check: bool,
                dir_fd: int | None) -> os.stat_result:
    end = 0
    for shard in f.shards:
        if shard.src_offset != end:
            raise RestoreError(f"manifest gap: shard at byte {shard.src_offset:,}, the shards before end at {end:,}")
        end += shard.length
    if end != f.size:
        raise RestoreError(f"manifest gap: the shards cover {end:,} bytes of a file of {f.size:,}")
    # A new file, never through a symlink (docs/design.md, invariant 7): the staging path is
    # predictable, and whoever planted something there does not get our bytes written through it.
    # The hash reads back through the same descriptor: the name is never opened again.
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    written = _Written(progress)
    whole = hashlib.sha256()
    stop = threading.Event()
    try:
        behind = WriteBehind(fd)
        block = memoryview(bytearray(BLOCK))
        streams = _streams(f)
        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="ckpt-fetch") as pool:
            futures = [pool.submit(_shard_into, fd, f.relpath, shard, how, written, stop, check) for shard in f.shards]
            try:
                for shard, fut in zip(f.shards, futures, strict=True):
                    fut.result()
                    _hash_range(fd, shard.src_offset, shard.length, whole, block)
                    behind.written(shard.src_offset + shard.length)
            except BaseException:
                stop.set()  # the shards under way end at their next block
                for fut in futures:
                    fut.cancel()
                raise
        os.ftruncate(fd, f.size)
        failpoints.hit("restore.fsync")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # a restore does not flood the page cache
        created = os.fstat(fd)
    finally:
        os.close(fd)
    actual = whole.hexdigest()
    if actual != f.sha256:
        written(-written.total)
        raise HashMismatch(f"restored {f.relpath or 'file'}", f.sha256, actual)
    return created


def _streams(f: FileSource) -> int:
    """How many of the file's shards to fetch at once: one per worker holding them, at most
    ``STREAMS`` (``LOCAL_STREAMS`` when they are all on this host); ``STREAMS`` from an object
    store (it serves many GETs at once, each shard's ranges in parallel too)."""
    urls = {url: worker for sh in f.shards for worker, url in sh.copies if not on_store(url)}
    stores = any(on_store(url) for sh in f.shards for _worker, url in sh.copies)
    local = bool(urls) and all(is_loopback(urlsplit(u).hostname) for u in urls)
    sources = len(set(urls.values())) + (STREAMS if stores else 0)
    return max(1, min(LOCAL_STREAMS if local else STREAMS, sources, len(f.shards)))


def _shard_into(fd: int, relpath: str, shard: ShardSource, how: _How, written: _Written, stop: threading.Event,
                check: bool) -> None:
    """Fetch one shard (pipeline.restoring.gather.fetch) and write its payload at its offset."""
    pos, skip = shard.src_offset, shard.payload_offset

    def take(chunk: memoryview) -> memoryview:  # a safetensors shard starts with its own header
        nonlocal skip
        if skip:
            if len(chunk) <= skip:
                skip -= len(chunk)
                return chunk[:0]
            chunk, skip = chunk[skip:], 0
        return chunk

    def write(chunk: memoryview) -> None:
        nonlocal pos
        if stop.is_set():
            raise RestoreError("stopped: another shard of the file failed")
        failpoints.hit("restore.write")
        _pwrite_all(fd, chunk, pos)
        pos += len(chunk)
        written(len(chunk))

    def reset() -> None:  # forget what a bad copy gave
        nonlocal pos, skip
        written(shard.src_offset - pos)
        pos, skip = shard.src_offset, shard.payload_offset

    if stop.is_set():
        raise RestoreError("stopped: another shard of the file failed")
    read_from = fetch(shard, how.key, (write,), reset, check=check, inline=take, wire=how.wire, settings=how.settings)
    how.tally.record(relpath, shard, read_from)


def _hash_range(fd: int, offset: int, length: int, whole: hashlib._Hash, block: memoryview) -> None:
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [block[: min(len(block), end - offset)]], offset)
        if not n:
            raise RestoreError(f"the file being rebuilt ends at byte {offset:,}, before {end:,}")
        whole.update(block[:n])
        offset += n


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n

