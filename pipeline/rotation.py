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
from pipeline.errors import WorkerError
from pipeline.retention import LocalCheckpoint, to_rotate
from pipeline.settings import Settings
from pipeline import trash
from pipeline.trash import move_to_trash, put_back
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
        _empty_trash(s, run)
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


def _empty_trash(session: Session, run: str) -> None:
    """Delete what rotations that committed left in the run's trash (a crash came before
    their delete); an entry whose rotation did not commit is left for it to put back."""
    for entry, was in trash.entries(run):
        rows = session.scalars(select(Checkpoint).where(Checkpoint.path == str(was))).all()
        undecided = any(c.local_present and not os.path.lexists(was) for c in rows)
        rotated = any(not c.local_present and getattr(latest_store_job(session, c.id), "state", None) == S.ROTATED
                      for c in rows)
        if rotated and not undecided:
            trash.remove(entry)
            log.info("removed %s, left by a rotation that committed", entry)


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
    changed = changed_since_detection(session.get(Checkpoint, checkpoint_id))
    if changed:
        return f"{changed}; its new content is not protected yet"
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


def changed_since_detection(ckpt: Checkpoint) -> str | None:
    """What on the local copy differs from what was detected (and stored), or None.

    A file rewritten in place, or a file added to a checkpoint folder since, holds bytes
    that no replica has: deleting the local copy would lose them.
    """
    recorded = {f.relpath: f for f in ckpt.files}
    root = Path(ckpt.path)
    if ckpt.is_dir and root.is_dir():
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if rel not in recorded:
                    return f"{rel} was added to {root} after it was stored"
    for rel, f in recorded.items():
        path = root / rel if rel else root
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue  # gone already: nothing of it left to lose
        if (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
            return f"{path} changed after it was stored ({st.st_size:,} bytes, modified {st.st_mtime_ns})"
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

    trashed = None
    try:
        with session_scope(settings.db_url) as s:
            # The deciding transaction (BEGIN IMMEDIATE on SQLite, the job row locked on
            # PostgreSQL): nothing changes under it, and a duplicate delivery waits, then
            # finds the job rotated.
            job = s.scalar(select(Job).where(Job.id == job_id).with_for_update())
            ckpt = s.scalar(select(Checkpoint).where(Checkpoint.id == checkpoint_id).with_for_update())
            if job.state != S.VERIFIED or not ckpt.local_present:
                return []
            if put_back(path):  # a rotation crashed after its rename, before its commit
                log.warning("job %d: %s was in the trash of a rotation that did not commit; put back", job_id, path)
            reason = unsafe_reason(s, settings, checkpoint_id, job_id)
            if reason is None:
                trashed = move_to_trash(Path(path)) if os.path.lexists(path) else None
                s.get(Checkpoint, checkpoint_id).local_present = False
                transition(s, job_id, "store", S.VERIFIED, S.ROTATED, blocked_reason=None,
                           detail=f"local copy removed; {settings.rf}+ verified replicas remain")
    except BaseException:
        if trashed is not None:
            os.rename(trashed, path)  # undo: the transaction that allowed it did not commit
        raise
    if reason:
        _block(settings, job_id, reason)
        return []
    if trashed is not None:
        trash.remove(Path(trashed))
    log.info("rotated %s (job %d)", path, job_id)
    return []


def _block(settings: Settings, job_id: int, reason: str) -> None:
    text = f"rotation blocked: {reason}"
    with session_scope(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is not None and job.blocked_reason != text:
            job.blocked_reason = text
            note(s, job_id, text)
    log.warning("job %d: %s", job_id, text)
