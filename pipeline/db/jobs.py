"""Jobs looked up by kind and state, along the ``(kind, state)`` index, whatever the planner's
statistics say.

States are skewed: at 100k checkpoints nearly every store job has ended (forgotten, rotated)
and a handful are active. Once ``PRAGMA optimize`` (pipeline.db.engine.optimize) has counted
the jobs, SQLite knows only the average rows per state, so one query over an OR of the active
(kind, state) pairs is planned as a scan of every job (~35 ms), where before it took 0.1 ms.
One equality lookup per pair is the best plan under any statistics.
"""
from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db.models import Job

Pair = tuple[str, str]


def active_pairs() -> list[Pair]:
    """Every (kind, state) in which a job is still being worked on."""
    return sorted((k, s) for k, v in states.ACTIVE.items() for s in v)


def failed_pairs() -> list[Pair]:
    """Every (kind, failed)."""
    return sorted((k, "failed") for k in states.TRANSITIONS if "failed" in states.all_states(k))


def newest(session: Session, pairs: Iterable[Pair], limit: int) -> list[Job]:
    """The newest ``limit`` jobs in any of ``pairs``, newest first."""
    found: list[Job] = []
    for kind, state in pairs:
        found += session.scalars(select(Job).where(Job.kind == kind, Job.state == state)
                                 .order_by(Job.id.desc()).limit(limit))
    return sorted(found, key=lambda j: j.id, reverse=True)[:limit]


def count(session: Session, pairs: Iterable[Pair]) -> int:
    """How many jobs are in any of ``pairs``."""
    return sum(session.scalar(select(func.count(Job.id)).where(Job.kind == kind, Job.state == state)) or 0
               for kind, state in pairs)
