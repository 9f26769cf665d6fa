"""Remote retention in the control plane: pins, ``ckpt forget`` and the policy sweep.

A checkpoint the policy (pipeline.core.retention) drops, or that a person forgets, moves
its store job to ``forgotten``: it can no longer be restored, its local copy is left to the
local policy (which rotates it like any other: pipeline.store.rotation), and its content
becomes garbage once no kept checkpoint references it and its local copy is gone (the
collection's grace period starts at the forget: pipeline.integrity.gc). The newest save of
a run, by every measure of pipeline.core.retention.newest_ids, and the save ``latest()``
answers (:func:`resumed_from`) are never forgotten. Only protected checkpoints
(``verified``, ``rotated``) are considered or forgotten: one still being stored keeps
everything it references.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.core.retention import Protected, kept, newest_ids, recency
from pipeline.core.savegroups import save_group
from pipeline.db.models import Checkpoint, Job, JobEvent
from pipeline.db.newest import newest_protected
from pipeline.db.transitions import latest_store_ids, now, transition
from pipeline.detection.catalog import latest_store_job, resolve
from pipeline.errors import CkptError
from pipeline.settings import Settings
from pipeline.states import JobKind
from pipeline.states import StoreState as S

log = logging.getLogger("ckpt.retention")


@dataclass(frozen=True)
class Verdict:
    """What the policy (or a forget) decides for one checkpoint."""

    checkpoint_id: int
    path: str
    step: int | None
    bytes: int
    keep: bool
    why: str


def protected(session: Session, run: str) -> list[tuple[Checkpoint, Protected]]:
    """The protected current checkpoints of ``run``, with what the policy needs of each."""
    q = (select(Checkpoint).join(Job, Job.checkpoint_id == Checkpoint.id)
         .where(Checkpoint.run == run, Checkpoint.current.is_(True), Checkpoint.released_at.is_(None),
                Job.id.in_(latest_store_ids()), Job.state.in_(sorted(states.PROTECTED))))
    return [(c, Protected(c.id, c.step, datetime.fromtimestamp(c.mtime, UTC), c.pinned, c.metrics or {},
                          "" if c.is_dir else save_group(c.name)))
            for c in session.scalars(q)]


def plan_run(session: Session, settings: Settings, run: str) -> list[Verdict]:
    """The policy's verdict on every protected checkpoint of ``run``, newest first."""
    rows = protected(session, run)
    keep = kept([p for _c, p in rows], settings.policy_for(run))
    for cid in resumed_from(session, run):  # what latest() answers, when the newest save is not whole yet
        keep.setdefault(cid, []).append("what a resume restores")
    order = {c.id: recency(c.mtime, c.step, c.id) for c, _p in rows}
    out = [Verdict(c.id, c.path, c.step, c.total_bytes, c.id in keep, ", ".join(keep.get(c.id, ["dropped"])))
           for c, _p in rows]
    return sorted(out, key=lambda v: order[v.checkpoint_id], reverse=True)


def resumed_from(session: Session, run: str) -> set[int]:
    """The checkpoints of the save ``latest()`` answers for ``run`` (pipeline.db.newest): kept
    by every rule, beside the newest by each measure, which may be files of a save not yet
    protected whole."""
    found = newest_protected(session, run)
    return {c.id for c in (found[0], *found[1])} if found is not None else set()


def runs_with_policy(session: Session, settings: Settings) -> list[str]:
    runs = session.scalars(select(Checkpoint.run).where(Checkpoint.released_at.is_(None)).distinct())
    return sorted(r for r in runs if settings.policy_for(r).is_set)


def forget_checkpoint(session: Session, checkpoint_id: int, why: str) -> bool:
    """Move one protected checkpoint to ``forgotten``; False if it is not protected now."""
    job = latest_store_job(session, checkpoint_id)
    if job is None or job.state not in states.PROTECTED:
        return False
    return transition(session, job.id, JobKind.STORE, job.state, S.FORGOTTEN, detail=why)


def apply_policy(session: Session, settings: Settings) -> list[Verdict]:
    """Forget what each run's policy drops (the scheduler's sweep); the forgotten."""
    gone = []
    for run in runs_with_policy(session, settings):
        for v in plan_run(session, settings, run):
            if not v.keep and forget_checkpoint(session, v.checkpoint_id, f"retention policy of {run}: "
                                                f"{settings.policy_for(run).describe()}"):
                gone.append(v)
    if gone:
        log.info("retention: forgot %d checkpoints (%d bytes)", len(gone), sum(v.bytes for v in gone))
    return gone


def forget(session: Session, refs: list[str], *, dry_run: bool = False) -> list[Verdict]:
    """``ckpt forget``: the named checkpoints (ids or paths) become ``forgotten``.

    Refuses, naming the reason, a checkpoint that is pinned or not protected, and the newest
    protected checkpoint of its run (what a resume restores); nothing is forgotten unless
    every named one can be.
    """
    out = []
    for ref in refs:
        c = resolve(session, ref)
        job = latest_store_job(session, c.id)
        state = job.state if job is not None else "unknown"
        if state == S.FORGOTTEN:
            raise CkptError(f"checkpoint {c.id} ({c.path}) is already forgotten")
        if state not in states.PROTECTED:
            raise CkptError(f"checkpoint {c.id} ({c.path}) is {state}: only protected (verified or rotated) "
                            "checkpoints can be forgotten")
        if c.pinned:
            raise CkptError(f"checkpoint {c.id} ({c.path}) is pinned; `ckpt unpin {c.id}` first")
        if c.id in newest_ids((p for _c, p in protected(session, c.run)), lambda p: p.saved_at.timestamp()) \
                or c.id in resumed_from(session, c.run):
            raise CkptError(f"checkpoint {c.id} ({c.path}) is the newest protected checkpoint of {c.run}: "
                            "it is what a resume restores, and is always kept")
        out.append(Verdict(c.id, c.path, c.step, c.total_bytes, False, "ckpt forget"))
    if not dry_run:
        for v in out:
            forget_checkpoint(session, v.checkpoint_id, "forgotten by `ckpt forget`")
    return out


def pin(session: Session, ref: str, note: str | None, *, pinned: bool = True) -> Checkpoint:
    """Pin (never forgotten by the policy or `ckpt forget`) or unpin one checkpoint."""
    c = resolve(session, ref)
    job = latest_store_job(session, c.id)
    if pinned and job is not None and job.state == S.FORGOTTEN:
        raise CkptError(f"checkpoint {c.id} ({c.path}) is already forgotten: it cannot be pinned")
    c.pinned, c.pin_note = pinned, (note if pinned else None)
    return c


def compact_history(session: Session, settings: Settings, limit: int = 5000) -> int:
    """Drop the job events of checkpoints forgotten (or superseded) more than
    ``forgotten_history_days`` ago; the jobs stay, with their final state. Events deleted."""
    cutoff = now() - timedelta(days=settings.forgotten_history_days)
    old = select(Job.id).join(Checkpoint, Checkpoint.id == Job.checkpoint_id).where(
        Checkpoint.released_at.is_not(None), Checkpoint.released_at < cutoff)
    ids = list(session.scalars(select(JobEvent.id).where(JobEvent.job_id.in_(old)).limit(limit)))
    if ids:
        session.execute(delete(JobEvent).where(JobEvent.id.in_(ids)).execution_options(synchronize_session=False))
    return len(ids)
