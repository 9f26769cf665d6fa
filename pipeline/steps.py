"""What every pipeline step shares: attempts, failure, follow-up messages.

A step runs short transactions around its I/O and returns the messages to send once
they committed (docs/design.md, invariant 3: commit, then act).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db.models import Job
from pipeline.db.transitions import note, start_attempt, transition
from pipeline.errors import AttemptsExhausted, MissingRow
from pipeline.settings import Settings


@dataclass(frozen=True)
class Send:
    """A message to enqueue after the deciding transaction committed."""

    actor: str
    args: tuple[Any, ...]


def begin_step(session: Session, settings: Settings, job_id: int, expected: str) -> Job | None:
    """Count an attempt of ``job_id``'s step ``expected``; None if the step is already over.

    Raises :class:`AttemptsExhausted` once the attempts (crash redeliveries included)
    pass ``settings.max_attempts``.
    """
    attempt = start_attempt(session, job_id, expected, settings.lease_seconds)
    if attempt is None:
        return None
    job = session.get(Job, job_id, populate_existing=True)  # the row as the UPDATE left it
    if job is None:
        raise MissingRow("jobs", job_id)
    if attempt > settings.max_attempts:
        raise AttemptsExhausted(f"{job.kind} job {job_id} step {expected!r}", attempt - 1, job.last_error)
    return job


def start_job(session: Session, settings: Settings, job_id: int, kind: str, queued: str, working: str) -> Job | None:
    """Begin (or resume) a job that goes ``queued -> working``; None when there is nothing to do.

    Counts the attempt of whatever step the job is in (crash redeliveries included), and
    moves a queued job to its working state in the same transaction.
    """
    job = session.get(Job, job_id)
    if job is None or job.state in states.TERMINAL[kind]:
        return None
    expected = job.state
    job = begin_step(session, settings, job_id, expected)
    if job is not None and expected == queued:
        transition(session, job_id, kind, queued, working, lease_seconds=settings.lease_seconds,
                   attempts=job.attempts)
    return job


def fail_job(session: Session, job_id: int, error: str) -> bool:
    """Mark a job ``failed`` with ``error``, from whatever non-terminal state it is in."""
    job = session.get(Job, job_id)
    if job is None:
        return False
    # Its state as the database has it: a transition earlier in this transaction (start_job)
    # updated the row without refreshing the object.
    state = session.scalar(select(Job.state).where(Job.id == job_id))
    if state is None or state in states.TERMINAL[job.kind]:
        return False
    # Remember where it failed, so a requeue from the dead-letter queue resumes there.
    params = dict(job.params or {}, failed_from=state)
    return transition(session, job_id, job.kind, state, "failed", detail=error, last_error=error,
                      attempts=job.attempts, params=params)


def record_error(session: Session, job_id: int, error: str) -> None:
    """Remember the error of a failed attempt on the job and its timeline."""
    job = session.get(Job, job_id)
    if job is not None:
        job.last_error = error
        note(session, job_id, f"attempt {job.attempts} failed: {error}")
