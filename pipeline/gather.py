"""Fetching shards back: from the first healthy replica, falling back to the next.

Every byte fetched is hashed and compared to the manifest (DESIGN invariant 4); a
replica that errors or does not match is skipped for the next one.
"""
from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import Checkpoint, CheckpointFile, Replica, Shard
from pipeline.errors import HashMismatch, RestoreError, WorkerError
from pipeline.hashing import side_thread
from pipeline.worker_client import WorkerClient

log = logging.getLogger("ckpt.gather")
BLOCK = 4 * 1024 * 1024
#: A worker sends a shard without pause: this long without a byte, the copy is given up
#: for the next replica (a peer that vanished without a reset would hang a restore).
FETCH_TIMEOUT = 30.0
_PREFERENCE = {"verified": 0, "stored": 1}


@dataclass(frozen=True)
class ShardSource:
    sha256: str
    size: int
    kind: str
    src_offset: int
    length: int
    payload_offset: int
    #: (worker id, url), best first: verified before stored, live workers before down ones.
    replicas: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class FileSource:
    relpath: str
    size: int
    sha256: str
    format: str
    shards: tuple[ShardSource, ...]


def manifest(session: Session, checkpoint: Checkpoint) -> list[FileSource]:
    """Plain-data manifest of ``checkpoint`` with its replicas ordered by preference."""
    out = []
    for f in session.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint.id)
                             .order_by(CheckpointFile.relpath)):
        shards = []
        for sh in session.scalars(select(Shard).where(Shard.file_id == f.id).order_by(Shard.seq)):
            reps = [r for r in session.scalars(select(Replica).where(Replica.shard_id == sh.id))
                    if r.state in _PREFERENCE]
            reps.sort(key=lambda r: (r.worker.state != "up", _PREFERENCE[r.state], r.id))
            shards.append(ShardSource(sh.sha256, sh.size, sh.kind, sh.src_offset, sh.length, sh.payload_offset,
                                      tuple((r.worker_id, r.worker.url) for r in reps)))
        out.append(FileSource(f.relpath, f.size, f.sha256, f.format, tuple(shards)))
    return out


def read_ahead(shards: Iterable[ShardSource], key: bytes) -> Iterator[ShardSource]:
    """Yield ``shards`` in order; before each, ask the worker that will serve the next one
    to start reading it from its disk, so that its read overlaps this shard's transfer."""
    items = list(shards)
    for i, shard in enumerate(items):
        if i + 1 < len(items) and items[i + 1].replicas:
            _worker_id, url = items[i + 1].replicas[0]
            try:
                WorkerClient(url, key).prefetch([items[i + 1].sha256])
            except WorkerError as exc:  # only a hint: the fetch itself will report the worker
                log.debug("prefetch hint to %s failed: %s", url, exc)
        yield shard


def fetch(shard: ShardSource, key: bytes, sink: Callable[[memoryview], None],
          reset: Callable[[], None]) -> str:
    """Stream ``shard`` into ``sink`` from the first replica whose bytes match the manifest.

    ``sink`` receives every byte of the shard in order; ``reset`` is called before a
    fallback so the caller can discard what a bad replica gave. Returns the worker id used.

    Two blocks are in flight: while a helper thread runs ``sink`` on one (a write and the
    caller's own hash, say), this thread receives and hashes the next. Socket reads,
    hashlib and ``os.pwrite`` release the GIL, so the two run on two cores.
    """
    if not shard.replicas:
        raise RestoreError(f"shard {shard.sha256[:12]} has no stored replica")
    views = (memoryview(bytearray(BLOCK)), memoryview(bytearray(BLOCK)))
    side = side_thread()
    errors = []
    for worker_id, url in shard.replicas:
        try:
            conn, resp = WorkerClient(url, key, timeout=FETCH_TIMEOUT).open_shard(shard.sha256)
        except WorkerError as exc:
            errors.append(f"{worker_id}: {exc.reason}")
            continue
        h = hashlib.sha256()
        got, blocks, broke = 0, 0, False
        pending: Future | None = None
        try:
            while True:
                # This buffer's last sink finished before the one now pending was submitted.
                view = views[blocks % 2]
                try:
                    n = resp.readinto(view)
                except OSError as exc:
                    errors.append(f"{worker_id}: transfer broke after {got:,} bytes ({exc})")
                    broke = True
                    break
                if not n:
                    break
                chunk = view[:n]
                h.update(chunk)
                if pending is not None:
                    pending.result()  # in order; the sink's own errors are raised here
                pending = side.submit(sink, chunk)
                got, blocks = got + n, blocks + 1
            if pending is not None:
                pending.result()
        finally:
            if pending is not None:
                wait([pending])
            conn.close()
        if broke:
            reset()
            continue
        actual = h.hexdigest()
        if got == shard.size and actual == shard.sha256:
            return worker_id
        errors.append(str(HashMismatch(f"shard {shard.sha256[:12]} from {worker_id}", shard.sha256, actual)))
        log.warning("falling back: %s", errors[-1])
        reset()
    raise RestoreError(f"no healthy replica of shard {shard.sha256[:12]}: " + "; ".join(errors))
