"""Entries detection cannot protect as they are, reported once (status, UI, metrics).

A row per host and path (two hosts may each have an entry at one path): written when the
watcher first finds the entry unreadable (a name that is not UTF-8, a tree nested too deep,
hostile JSON) or stuck incomplete for a whole quiet period, refreshed quietly after that, and
removed when the entry is protected or is gone.
"""
from __future__ import annotations

import re

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from pipeline.db.models import DetectionProblem
from pipeline.db.transitions import now

#: Longest reason kept.
MAX_REASON = 2000
_NUMBER = re.compile(r"\d[\d,.]*")


def kind_of(reason: str) -> str:
    """The kind of a problem: its reason with every number masked. A problem is logged when
    it appears or changes kind, not when only its numbers change (seconds waited, bytes)."""
    return _NUMBER.sub("#", reason)


def report(session: Session, path: str, run: str, reason: str, host: str = "") -> bool:
    """Record ``reason`` for ``path`` on ``host``; True when it is new (or changed): the caller
    logs it then."""
    reason = reason[:MAX_REASON]
    t = now()
    row = session.scalar(select(DetectionProblem).where(DetectionProblem.host == host, DetectionProblem.path == path))
    if row is None:
        session.add(DetectionProblem(host=host, path=path, run=run, reason=reason, first_seen=t, last_seen=t))
        return True
    row.last_seen = t
    if row.reason != reason:
        row.reason = reason
        return True
    return False


def clear(session: Session, path: str, host: str = "") -> None:
    """``path`` on ``host`` is fine now (protected, or no longer a problem)."""
    session.execute(delete(DetectionProblem).where(DetectionProblem.host == host, DetectionProblem.path == path))


def clear_all(session: Session, host: str = "") -> None:
    """Forget ``host``'s problems, and those found before hosts were (its watcher starting
    finds them again); another host's are its watcher's to keep or clear."""
    session.execute(delete(DetectionProblem).where(DetectionProblem.host.in_(sorted({host, ""}))))


def listed(session: Session, limit: int = 1000) -> list[DetectionProblem]:
    return list(session.scalars(select(DetectionProblem).order_by(DetectionProblem.id.desc()).limit(limit)))
