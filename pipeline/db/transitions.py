"""The one function that changes a job's state.

``transition`` is a compare-and-set ``UPDATE jobs SET state = :target WHERE id = :id
AND state = :expected`` that writes the timeline row in the same transaction (the
caller's). A repeat of a transition that already happened is a no-op; an edge the
state machine lacks raises :class:`~pipeline.errors.InvalidTransition`.
"""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from pipeline import failpoints, states
from pipeline.db.engine import rowcount
from pipeline.db.models import Checkpoint, CheckpointFile, Content, Job, JobEvent, Shard
from pipeline.errors import InvalidTransition, UnknownJob


def now() -> datetime:
    """The wall clock, in UTC (skewed by a fault test only: pipeline.failpoints.clock_offset)."""
    return datetime.now(UTC) + timedelta(seconds=failpoints.clock_offset())


def transition(
    session: Session,
    job_id: int,
    kind: str,
    expected: str,
    target: str,
    *,
    detail: str | None = None,
    lease_seconds: float | None = None,
    **values: Any,
) -> bool:
    """Move job ``job_id`` from ``expected`` to ``target``; True if this call moved it.

    ``values`` are further columns set in the same UPDATE. A new step starts with its
    attempts at zero and, when ``lease_seconds`` is given, a fresh lease; a job that comes to
    rest (``states.RESTING``) keeps the attempts its last step took, as it is shown.
    """
    expected, target = str(expected), str(target)
    if not states.allowed(kind, expected, target):
        raise InvalidTransition(kind, job_id, expected, target)
    t = now()
    if target not in states.RESTING[kind]:
        values.setdefault("attempts", 0)
    if lease_seconds is not None:
        values["lease_until"] = t + timedelta(seconds=lease_seconds)
    if target in states.TERMINAL[kind]:
        values.setdefault("finished_at", t)
        values.setdefault("lease_until", None)
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == expected)
        .values(state=target, updated_at=t, **values)
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) == 1:
        session.add(JobEvent(job_id=job_id, at=t, from_state=expected, to_state=target, detail=detail))
        if kind == states.JobKind.STORE:
            _show_store_state(session, job_id, target)
            if target in states.RELEASED:
                release(session, job_id, t)
        return True
    current = session.scalar(select(Job.state).where(Job.id == job_id))
    if current is None:
        raise UnknownJob(job_id)
    if current == target:
        return False
    raise InvalidTransition(kind, job_id, current, target)


def _show_store_state(session: Session, job_id: int, state: str) -> None:
    """Copy a store job's new state onto its checkpoint, unless a newer store job of the same
    checkpoint already speaks for it."""
    newer = aliased(Job)
    session.execute(
        update(Checkpoint)
        .where(Checkpoint.id == select(Job.checkpoint_id).where(Job.id == job_id).scalar_subquery(),
               ~select(newer.id).where(newer.kind == states.JobKind.STORE, newer.checkpoint_id == Checkpoint.id,
                                       newer.id > job_id).exists())
        .values(store_state=state).execution_options(synchronize_session=False))


def release(session: Session, job_id: int, at: datetime) -> None:
    """The checkpoint of store job ``job_id`` no longer holds its content (superseded, vanished,
    forgotten): record when, and start its contents' garbage-collection grace period now."""
    checkpoint_id = session.scalar(select(Job.checkpoint_id).where(Job.id == job_id))
    if checkpoint_id is None:
        return
    session.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.released_at.is_(None))
                    .values(released_at=at).execution_options(synchronize_session=False))
    shas = select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id)
    session.execute(update(Content).where(Content.sha256.in_(shas)).values(last_referenced_at=at)
                    .execution_options(synchronize_session=False))


def create_job(
    session: Session,
    kind: str,
    *,
    checkpoint_id: int | None,
    params: dict[str, Any] | None = None,
    lease_seconds: float = 60.0,
    bytes_total: int = 0,
    detail: str | None = None,
    dedupe_key: str | None = None,
    sha256: str | None = None,
    started_at: datetime | None = None,
) -> Job:
    """Insert a job in its kind's initial state, with the first timeline row.

    ``started_at``: when its work began, if before this row (a store whose uploads started
    while detection was hashing: pipeline.store.early); its ``created_at``.

    With ``dedupe_key``, a second job with the same key violates a unique constraint:
    callers that expect duplicates use :func:`create_job_once`.
    """
    t = now()
    job = Job(
        kind=kind,
        checkpoint_id=checkpoint_id,
        state=states.INITIAL[kind],
        params=params or {},
        attempts=0,
        bytes_done=0,
        bytes_total=bytes_total,
        created_at=min(t, started_at) if started_at is not None else t,
        updated_at=t,
        lease_until=t + timedelta(seconds=lease_seconds),
        dedupe_key=dedupe_key,
        sha256=sha256,
    )
    session.add(job)
    session.flush()
    session.add(JobEvent(job_id=job.id, at=t, from_state=None, to_state=job.state, detail=detail))
    if kind == states.JobKind.STORE and checkpoint_id is not None:
        _show_store_state(session, job.id, job.state)
    return job


def latest_store_ids(*where: ColumnElement[bool]) -> Select[Any]:
    """Ids of each checkpoint's newest store job (its state is the checkpoint's state),
    optionally only of the jobs matching ``where``; for ``Job.id.in_(...)``."""
    return select(func.max(Job.id)).where(Job.kind == states.JobKind.STORE, *where).group_by(Job.checkpoint_id)


def create_job_once(session: Session, kind: str, dedupe_key: str, **kwargs: Any) -> Job | None:
    """Like :func:`create_job`, but None when a job with ``dedupe_key`` already exists."""
    if session.scalar(select(Job.id).where(Job.dedupe_key == dedupe_key)) is not None:
        return None
    try:
        with session.begin_nested():
            return create_job(session, kind, dedupe_key=dedupe_key, **kwargs)
    except IntegrityError:  # a concurrent scheduler (or double fire) created it first
        return None


def create_worker_jobs(session: Session, kind: str, worker_ids: list[str], params: dict[str, Any], detail: str,
                       *, lease_seconds: float, dedupe: str | None = None) -> list[Job]:
    """One job of ``kind`` per worker (``params`` and ``detail`` with the worker filled in);
    with ``dedupe``, none for a worker that already has the job ``{dedupe}:{worker}``."""
    jobs = []
    for w in worker_ids:
        kw: dict[str, Any] = {"checkpoint_id": None, "params": {"worker_id": w, **params},
                              "lease_seconds": lease_seconds, "detail": detail.format(worker=w)}
        job = create_job_once(session, kind, f"{dedupe}:{w}", **kw) if dedupe else create_job(session, kind, **kw)
        if job is not None:
            jobs.append(job)
    return jobs


def note(session: Session, job_id: int, detail: str) -> None:
    """Add a timeline row that records something without changing the state."""
    state = session.scalar(select(Job.state).where(Job.id == job_id))
    if state is None:
        raise UnknownJob(job_id)
    session.add(JobEvent(job_id=job_id, at=now(), from_state=state, to_state=state, detail=detail))


def start_attempt(session: Session, job_id: int, expected: str, lease_seconds: float) -> int | None:
    """Count one more execution of the job's current step and renew its lease.

    Returns the attempt number, or None when the job is no longer in ``expected``
    (another delivery finished the step: the caller has nothing to do).
    """
    t = now()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == expected)
        .values(attempts=Job.attempts + 1, lease_until=t + timedelta(seconds=lease_seconds), updated_at=t)
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        return None
    return session.scalar(select(Job.attempts).where(Job.id == job_id))


def renew_lease(session: Session, job_id: int, lease_seconds: float, **values: Any) -> None:
    t = now()
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(lease_until=t + timedelta(seconds=lease_seconds), updated_at=t, **values)
        .execution_options(synchronize_session=False)
    )
