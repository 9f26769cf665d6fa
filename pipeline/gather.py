"""Fetching shards back: from the first healthy replica, falling back to the next.

Every byte fetched is hashed and compared to the manifest (DESIGN invariant 4); a
replica that errors or does not match is skipped for the next one.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import Checkpoint, CheckpointFile, Replica, Shard
from pipeline.errors import HashMismatch, RestoreError, WorkerError
from pipeline.worker_client import WorkerClient

log = logging.getLogger("ckpt.gather")
BLOCK = 4 * 1024 * 1024
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


def fetch(shard: ShardSource, key: bytes, sink: Callable[[memoryview], None],
          reset: Callable[[], None], buf: bytearray | None = None) -> str:
    """Stream ``shard`` into ``sink`` from the first replica whose bytes match the manifest.

    ``sink`` receives every byte of the shard in order; ``reset`` is called before a
    fallback so the caller can discard what a bad replica gave. Returns the worker id used.
    """
    if not shard.replicas:
        raise RestoreError(f"shard {shard.sha256[:12]} has no stored replica")
    buf = buf if buf is not None else bytearray(BLOCK)
    view = memoryview(buf)
    errors = []
    for worker_id, url in shard.replicas:
        try:
            conn, resp = WorkerClient(url, key).open_shard(shard.sha256)
        except WorkerError as exc:
            errors.append(f"{worker_id}: {exc.reason}")
            continue
        h = hashlib.sha256()
        got = 0
        try:
            while True:
                n = resp.readinto(view)
                if not n:
                    break
                h.update(view[:n])
                sink(view[:n])
                got += n
        except OSError as exc:
            errors.append(f"{worker_id}: transfer broke after {got:,} bytes ({exc})")
            reset()
            continue
        finally:
            conn.close()
        actual = h.hexdigest()
        if got == shard.size and actual == shard.sha256:
            return worker_id
        errors.append(str(HashMismatch(f"shard {shard.sha256[:12]} from {worker_id}", shard.sha256, actual)))
        log.warning("falling back: %s", errors[-1])
        reset()
    raise RestoreError(f"no healthy replica of shard {shard.sha256[:12]}: " + "; ".join(errors))
