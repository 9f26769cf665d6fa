"""Rebuilding one file from its shards, checked against the file's SHA-256 (docs/design.md, invariants 2 and 4).

Each shard's payload is written at its offset in the order of the manifest; every byte
written is hashed into the file's SHA-256, which must equal the one recorded at detection
before the file counts. A mismatch makes a second pass that checks every shard's own
SHA-256, finding the replica that sent bad bytes and reading that shard from another.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from pipeline import failpoints
from pipeline.durable import WriteBehind, fsync_dir
from pipeline.errors import HashMismatch, RestoreError
from pipeline.restore.gather import FileSource, ShardSource, fetch, read_ahead

log = logging.getLogger("ckpt.restore")
#: Called with the bytes written since the last call (negative: bytes taken back).
Progress = Callable[[int], None]

class _Rebuild:
    """Writes one file from its shards in order, hashing what it writes.

    ``take`` runs in the thread that receives (it drops each shard's own header); ``hash``
    and ``write`` each run in a helper thread of their own, on the same blocks in order.
    """

    def __init__(self, fd: int, progress: Progress | None = None) -> None:
        self.fd, self.progress = fd, progress
        self.behind = WriteBehind(fd)
        self.whole = hashlib.sha256()
        self.pos = 0
        self.skip = 0

    def begin(self, shard: ShardSource) -> None:
        if shard.src_offset != self.pos:
            raise RestoreError(f"manifest gap: shard at byte {shard.src_offset:,}, file rebuilt up to {self.pos:,}")
        self.shard, self.snapshot, self.skip = shard, self.whole.copy(), shard.payload_offset

    def take(self, chunk: memoryview) -> memoryview:
        if self.skip:  # a safetensors shard starts with its own header: not part of the file
            if len(chunk) <= self.skip:
                self.skip -= len(chunk)
                return chunk[:0]
            chunk, self.skip = chunk[self.skip:], 0
        return chunk

    def hash(self, chunk: memoryview) -> None:
        self.whole.update(chunk)

    def write(self, chunk: memoryview) -> None:
        failpoints.hit("restore.write")
        _pwrite_all(self.fd, chunk, self.pos)
        self.pos += len(chunk)
        self.behind.written(self.pos)
        if self.progress:
            self.progress(len(chunk))

    def reset(self) -> None:
        """Forget what a bad replica gave for the current shard."""
        if self.progress:
            self.progress(self.shard.src_offset - self.pos)
        self.pos, self.skip = self.shard.src_offset, self.shard.payload_offset
        self.whole = self.snapshot.copy()


def write_file(f: FileSource, out: Path, key: bytes, progress: Progress | None = None) -> None:
    """Rebuild one file at ``out`` from its shards; raise unless it matches its SHA-256.

    The file's SHA-256 covers every byte written, so the shards are not also hashed one by
    one (that hashed every byte twice, and was the restore's bottleneck on two cores). If
    the file does not match, it is rebuilt once more checking every shard's SHA-256, which
    finds the replica that sent bad bytes and reads that shard from another.
    """
    try:
        _write_file(f, out, key, progress, check=False)
    except HashMismatch as exc:
        log.warning("%s; rebuilding it checking every shard, to skip the bad copy", exc)
        os.unlink(out)
        _write_file(f, out, key, progress, check=True)


def _write_file(f: FileSource, out: Path, key: bytes, progress: Progress | None, *,
                check: bool) -> None:
    # A new file, never through a symlink (docs/design.md, invariant 7): the staging path is
    # predictable, and whoever planted something there does not get our bytes written through it.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    rebuild = _Rebuild(fd, progress)
    try:
        for shard in read_ahead(f.shards, key):
            rebuild.begin(shard)
            fetch(shard, key, (rebuild.hash, rebuild.write), rebuild.reset, check=check, inline=rebuild.take)
        os.ftruncate(fd, f.size)
        failpoints.hit("restore.fsync")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # a restore does not flood the page cache
    finally:
        os.close(fd)
    actual = rebuild.whole.hexdigest()
    if rebuild.pos != f.size or actual != f.sha256:
        if progress:
            progress(-rebuild.pos)
        raise HashMismatch(f"restored {f.relpath or 'file'}", f.sha256, actual)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def fsync_tree(root: Path) -> None:
    """fsync every directory of a rebuilt tree (the files were fsynced as written)."""
    for dirpath, _dirs, _names in os.walk(root):
        fsync_dir(Path(dirpath))
