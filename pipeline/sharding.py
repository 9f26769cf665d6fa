"""The shard step: ``detected -> sharded``.

Plans every file (pure planner), hashes the file and its shards in one read, checks the
file still matches what was detected, places each shard's replicas, and commits the
manifest and the transition together.
"""
from __future__ import annotations

import functools
import logging
import os
import time

from sqlalchemy import select

from pipeline import placement, states
from pipeline.catalog import file_path
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Replica, Shard
from pipeline.db.transitions import renew_lease, transition
from pipeline.header import Header, read_header, shard_header
from pipeline.hashing import scan
from pipeline.planner import ShardPlan, plan_opaque, plan_safetensors
from pipeline.replicas import live_candidates
from pipeline.settings import Settings
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


def plan_file(path: str, fmt: str, size: int, target: int) -> list[ShardPlan]:
    if fmt == "safetensors":
        return plan_safetensors(read_header(path), target)
    return plan_opaque(size, target)


def shard_checkpoint(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = begin_step(s, settings, job_id, S.DETECTED)
        if job is None:
            return []
        ckpt = s.get(Checkpoint, job.checkpoint_id)
        files = [(f.id, f.relpath, file_path(ckpt, f), f.format, f.size, f.sha256) for f in ckpt.files]
        ckpt_path = ckpt.path

    keep_alive = _LeaseKeeper(settings, job_id)
    manifest: list[tuple[int, ShardPlan, str]] = []
    for file_id, rel, path, fmt, size, sha in files:
        try:
            plans = plan_file(path, fmt, size, settings.shard_size)
            file_sha, shard_shas = scan(path, plans, expected_size=size, progress=keep_alive)
        except (OSError, ValueError) as exc:
            changed = f"{rel or ckpt_path} can no longer be read as detected ({exc})"
            return _supersede(settings, job_id, changed)
        if file_sha != sha:
            return _supersede(settings, job_id, f"{rel or ckpt_path}: content changed since detection")
        manifest.extend((file_id, p, h) for p, h in zip(plans, shard_shas))

    sends: list[Send] = []
    with session_scope(settings.db_url) as s:
        workers = live_candidates(s)
        for file_id, plan, sha in manifest:
            shard = Shard(file_id=file_id, seq=plan.seq, kind=plan.kind, sha256=sha, size=plan.size,
                          src_offset=plan.src_offset, length=plan.length, payload_offset=plan.payload_offset,
                          tensors=list(plan.tensors) or None)
            s.add(shard)
            for worker_id in placement.place(sha, workers, settings.rf):
                shard.replicas.append(Replica(worker_id=worker_id, state="pending"))
        s.flush()
        moved = transition(s, job_id, "store", S.DETECTED, S.SHARDED, lease_seconds=settings.lease_seconds,
                           detail=f"{len(manifest)} shards, RF {settings.rf}", bytes_done=0,
                           bytes_total=settings.rf * sum(p.size for _f, p, _h in manifest))
        if not moved:
            raise RuntimeError("job left 'detected' while sharding; rolling back this manifest")
        replica_ids = s.scalars(
            select(Replica.id).join(Shard).where(Shard.file_id.in_([f[0] for f in files]))
        ).all()
        sends = [Send("replicate", (rid,)) for rid in replica_ids]
    log.info("job %d: %d shards, %d replicas to send", job_id, len(manifest), len(sends))
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


def _supersede(settings: Settings, job_id: int, why: str) -> list[Send]:
    with session_scope(settings.db_url) as s:
        transition(s, job_id, "store", S.DETECTED, S.SUPERSEDED, detail=why, last_error=why)
    log.warning("job %d superseded: %s", job_id, why)
    return []
