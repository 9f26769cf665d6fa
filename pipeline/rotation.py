"""Rotation: remove old local checkpoints, only when they are safely elsewhere.

DESIGN invariant 1. A local checkpoint is deleted only inside a transaction that sees
every shard with at least RF replicas on distinct live workers, each re-hashed by its
worker after the upload and within the freshness window, and no other active job on
the checkpoint; the workers are asked right before that transaction whether they still
hold every replica. When in doubt, the file stays and the job says why.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.catalog import latest_store_job
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Job, Replica, Shard
from pipeline.db.transitions import note, now, transition
from pipeline.durable import fsync_dir
from pipeline.errors import WorkerError
from pipeline.retention import LocalCheckpoint, to_rotate
from pipeline.settings import Settings
from pipeline.steps import Send
from pipeline.worker_client import WorkerClient

log = logging.getLogger("ckpt.rotate")
S = states.StoreState


def rotation_candidates(session: Session, run: str, keep_last: int) -> list[int]:
    """Checkpoint ids of ``run`` that the retention policy wants gone."""
    local = session.scalars(select(Checkpoint).where(Checkpoint.run == run, Checkpoint.local_present.is_(True)))
    return to_rotate([LocalCheckpoint(c.id, c.step, c.mtime) for c in local], keep_last)


def plan_run(settings: Settings, run: str) -> list[Send]:
    """Messages that rotate every checkpoint of ``run`` the policy wants gone and that is verified."""
    sends = []
    with session_scope(settings.db_url) as s:
        for cid in rotation_candidates(s, run, settings.keep_last):
            job = latest_store_job(s, cid)
            if job is None:
                continue
            if job.state == S.VERIFIED:
                sends.append(Send("rotate", (job.id,)))
            elif job.state not in states.TERMINAL["store"]:
                reason = f"rotation waits: the checkpoint is {job.state}, not yet verified"
                if job.blocked_reason != reason:
                    job.blocked_reason = reason
    return sends


def unsafe_reason(session: Session, settings: Settings, checkpoint_id: int, job_id: int) -> str | None:
    """Why deleting the local copy is not allowed now, or None if invariant 1 holds."""
    fresh_after = now() - timedelta(seconds=settings.freshness_seconds)
    active = session.scalar(
        select(Job.id).where(Job.checkpoint_id == checkpoint_id, Job.id != job_id,
                             Job.state.not_in(states.TERMINAL["restore"] | states.TERMINAL["store"] | {S.VERIFIED}))
        .limit(1)
    )
    if active is not None:
        return f"job {active} is still active on this checkpoint"
    rows = session.execute(
        select(CheckpointFile.relpath, Shard.id, Shard.seq, Replica)
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .outerjoin(Replica, Replica.shard_id == Shard.id)
        .where(CheckpointFile.checkpoint_id == checkpoint_id)
        .order_by(CheckpointFile.relpath, Shard.seq)
    ).all()
    if not rows:
        return "the checkpoint has no shard manifest"
    good: dict[int, set[str]] = defaultdict(set)
    label: dict[int, str] = {}
    for relpath, shard_id, seq, rep in rows:
        label[shard_id] = f"shard {seq} of {relpath or 'the file'}"
        if (
            rep is not None
            and rep.state == "verified"
            and rep.worker.state == "up"
            and rep.verified_at is not None
            and rep.verified_at >= fresh_after
            and rep.stored_at is not None
            and rep.verified_at >= rep.stored_at
        ):
            good[shard_id].add(rep.worker_id)
    for shard_id, what in label.items():
        n = len(good.get(shard_id, ()))
        if n < settings.rf:
            pinned = "; the local copy is pinned while the shard has no good replica" if n == 0 else ""
            return f"{what} has {n}/{settings.rf} fresh verified replicas on live workers{pinned}"
    return None


def confirm_with_workers(settings: Settings, checkpoint_id: int) -> str | None:
    """Ask the workers whether they still hold the copies that count, at the right size.

    Only fresh verified replicas on live workers are asked about; each shard needs RF
    confirmed copies. A worker that cannot answer confirms nothing.
    """
    fresh_after = now() - timedelta(seconds=settings.freshness_seconds)
    with session_scope(settings.db_url) as s:
        by_worker: dict[str, tuple[str, dict[str, int]]] = {}
        shards: dict[str, tuple[str, set[str]]] = {}  # sha -> (label, workers)
        for rep in s.scalars(select(Replica).join(Shard).join(CheckpointFile).where(
                CheckpointFile.checkpoint_id == checkpoint_id, Replica.state == "verified")):
            if rep.worker.state != "up" or rep.verified_at is None or rep.verified_at < fresh_after:
                continue
            url, sizes = by_worker.setdefault(rep.worker_id, (rep.worker.url, {}))
            sizes[rep.shard.sha256] = rep.shard.size
            shards.setdefault(rep.shard.sha256, (f"shard {rep.shard.seq} of {rep.shard.file.relpath or 'the file'}",
                                                 set()))
    key = settings.key()
    confirmed: dict[str, int] = {}
    problems = []
    for worker_id, (url, sizes) in by_worker.items():
        try:
            held = WorkerClient(url, key).stat(sorted(sizes))
        except WorkerError as exc:
            problems.append(f"worker {worker_id} could not confirm its replicas ({exc.reason})")
            continue
        for name, size in sizes.items():
            if held.get(name) == size:
                confirmed[name] = confirmed.get(name, 0) + 1
            else:
                problems.append(f"worker {worker_id} no longer holds shard {name[:12]} (answered size {held.get(name)})")
    for sha, (label, _ws) in shards.items():
        if confirmed.get(sha, 0) < settings.rf:
            why = "; ".join(problems[:3]) or "too few copies"
            return f"{label} has {confirmed.get(sha, 0)}/{settings.rf} copies confirmed by the workers: {why}"
    return None


def rotate(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.state != S.VERIFIED:
            return []
        ckpt = s.get(Checkpoint, job.checkpoint_id)
        if job.checkpoint_id not in rotation_candidates(s, ckpt.run, settings.keep_last):
            return []
        checkpoint_id, path = ckpt.id, ckpt.path
        reason = unsafe_reason(s, settings, checkpoint_id, job_id)
    reason = reason or confirm_with_workers(settings, checkpoint_id)
    if reason:
        _block(settings, job_id, reason)
        return []

    trash = None
    try:
        with session_scope(settings.db_url) as s:
            # The deciding transaction (BEGIN IMMEDIATE on SQLite): nothing changes under it.
            reason = unsafe_reason(s, settings, checkpoint_id, job_id)
            if reason is None:
                trash = _move_to_trash(Path(path)) if os.path.lexists(path) else None
                s.get(Checkpoint, checkpoint_id).local_present = False
                transition(s, job_id, "store", S.VERIFIED, S.ROTATED, blocked_reason=None,
                           detail=f"local copy removed; {settings.rf}+ verified replicas remain")
    except BaseException:
        if trash is not None:
            os.rename(trash, path)  # undo: the transaction that allowed it did not commit
        raise
    if reason:
        _block(settings, job_id, reason)
        return []
    if trash is not None:
        shutil.rmtree(trash) if os.path.isdir(trash) else os.unlink(trash)
    log.info("rotated %s (job %d)", path, job_id)
    return []


def _move_to_trash(path: Path) -> str:
    """Rename the checkpoint to a hidden name in its run (atomic; the watcher ignores it)."""
    trash = str(path.parent / f".ckpt-trash-{uuid.uuid4().hex[:8]}-{path.name}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    return trash


def _block(settings: Settings, job_id: int, reason: str) -> None:
    text = f"rotation blocked: {reason}"
    with session_scope(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is not None and job.blocked_reason != text:
            job.blocked_reason = text
            note(s, job_id, text)
    log.warning("job %d: %s", job_id, text)
