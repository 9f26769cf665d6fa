"""The shard step: ``detected -> sharded``.

Detection already planned every file and hashed it and its shards in one read (the
shard rows exist). This step places each shard's replicas and commits the placement and
the transition together. A file that still has the size and mtime it was detected with
is not read again: each storage worker hashes what it receives and refuses bytes that do
not match the manifest, which supersedes the job if the source changed anyway. A file
whose size or mtime moved is re-hashed (a ``touch`` is not a change).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import time

from sqlalchemy import select

from pipeline import states
from pipeline.core import placement
from pipeline.core.header import Header, shard_header
from pipeline.core.planner import plan
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, Replica, Shard
from pipeline.db.replicas import live_candidates
from pipeline.db.transitions import renew_lease, transition
from pipeline.detection.catalog import file_path
from pipeline.detection.completeness import read_header
from pipeline.hashing import scan
from pipeline.settings import Settings
from pipeline.states import JobKind, ReplicaState
from pipeline.steps import Send, begin_step

log = logging.getLogger("ckpt.shard")
S = states.StoreState


@functools.lru_cache(maxsize=64)
def _header_of(path: str, size: int, mtime_ns: int) -> Header:
    return read_header(path)


def shard_prefix(path: str, kind: str, tensors: tuple[str, ...] | list[str]) -> bytes:
    """The bytes a shard has before its payload: its own safetensors header (b"" for raw).

    Rebuilt from the source file's header, parsed once per file version (path, size and
    mtime) in this process rather than once per replica. Deterministic: the same bytes the
    planner hashed.
    """
    if kind != "safetensors":
        return b""
    st = os.stat(path)
    names = set(tensors)
    return shard_header([t for t in _header_of(path, st.st_size, st.st_mtime_ns).tensors if t.name in names])


def source_matches(src: str, kind: str, tensors: tuple[str, ...], offset: int, length: int, sha: str) -> bool:
    """Whether the shard's bytes in the source file still hash to ``sha`` (a worker that
    refused them got them damaged on the way, or the source changed: this tells which)."""
    try:
        h = hashlib.sha256(shard_prefix(src, kind, tensors))
        with open(src, "rb") as f:
            f.seek(offset)
            remaining = length
            while remaining and (chunk := f.read(min(remaining, 4 << 20))):
                h.update(chunk)
                remaining -= len(chunk)
        return not remaining and h.hexdigest() == sha
    except (OSError, ValueError):
        return False


def shard_checkpoint(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = begin_step(s, settings, job_id, S.DETECTED)
        if job is None:
            return []
        ckpt = one(s, Checkpoint, job.checkpoint_id)
        files = [(f.id, f.relpath or ckpt.path, file_path(ckpt, f), f.format, f.size, f.mtime_ns, f.sha256)
                 for f in ckpt.files]

    keep_alive = _LeaseKeeper(settings, job_id)
    for _file_id, name, path, fmt, size, mtime_ns, sha in files:
        try:
            st = os.stat(path)
            if (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
                continue
            # Touched since detection: read it again (a `touch` is not a change).
            plans = plan(read_header(path) if fmt == "safetensors" else None, size, settings.shard_size)
            file_sha, _shard_shas = scan(path, plans, expected_size=size, progress=keep_alive)
            if file_sha != sha:
                return _end(settings, job_id, S.SUPERSEDED, f"{name}: content changed since detection")
        except FileNotFoundError:
            return _end(settings, job_id, S.VANISHED, f"{name} was deleted before it was protected")
        except (OSError, ValueError) as exc:
            return _end(settings, job_id, S.SUPERSEDED, f"{name} can no longer be read as detected ({exc})")

    with session_scope(settings.db_url) as s:
        workers = live_candidates(s)
        file_ids = [f[0] for f in files]
        shards = s.scalars(select(Shard).where(Shard.file_id.in_(file_ids)).order_by(Shard.file_id, Shard.seq)).all()
        for shard in shards:
            if not shard.replicas:
                shard.replicas = [Replica(worker_id=w, state=ReplicaState.PENDING)
                                  for w in placement.place(shard.sha256, workers, settings.rf)]
        s.flush()
        moved = transition(s, job_id, JobKind.STORE, S.DETECTED, S.SHARDED, lease_seconds=settings.lease_seconds,
                           detail=f"{len(shards)} shards, RF {settings.rf}", bytes_done=0,
                           bytes_total=settings.rf * sum(sh.size for sh in shards))
        if not moved:
            raise RuntimeError("job left 'detected' while sharding; rolling back this placement")
        replica_ids = s.scalars(select(Replica.id).join(Shard).where(Shard.file_id.in_(file_ids))).all()
        sends = [Send("replicate", (rid,)) for rid in replica_ids]
    log.info("job %d: %d shards, %d replicas to send", job_id, len(shards), len(sends))
    return sends


class _LeaseKeeper:
    """Renews the job's lease while a long hash runs (at most every ``lease/4`` seconds),
    so the scheduler does not take a slow step for a lost one."""

    def __init__(self, settings: Settings, job_id: int) -> None:
        self.settings, self.job_id = settings, job_id
        self.every = max(1.0, settings.lease_seconds / 4)
        self.last = time.monotonic()

    def __call__(self, _n: int) -> None:
        if time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            with session_scope(self.settings.db_url) as s:
                renew_lease(s, self.job_id, self.settings.lease_seconds)


def _end(settings: Settings, job_id: int, state: S, why: str) -> list[Send]:
    """The source is not what was detected any more: ``superseded`` (changed) or ``vanished`` (gone)."""
    with session_scope(settings.db_url) as s:
        transition(s, job_id, JobKind.STORE, S.DETECTED, state, detail=why, last_error=why)
    log.warning("job %d %s: %s", job_id, state, why)
    return []
