"""Entries the watcher sees but does not record yet, and since when (docs/design.md, section 2).

A row per host and path, written when an entry starts waiting (its layout is incomplete, or it
waits out the root's quiet period) and again only when its files change or its reason changes
kind, never at every scan; removed when it is recorded, reported as a problem or gone. ``ckpt
status`` and the UI list them with the time left; a watcher that restarts reads them back, so
"incomplete for N s" goes on from when nothing changed, not from the restart.
"""
from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from pipeline.db.models import DetectionProblem, DetectionWait
from pipeline.detection.problems import MAX_REASON


def record(session: Session, host: str, path: str, run: str, reason: str, newest_ns: int, since: float,
           ready_at: float | None) -> None:
    """Write (or rewrite) the wait of ``path`` on ``host``."""
    row = session.scalar(select(DetectionWait).where(DetectionWait.host == host, DetectionWait.path == path))
    if row is None:
        row = DetectionWait(host=host, path=path)
        session.add(row)
    row.run, row.reason, row.newest_ns = run, reason[:MAX_REASON], newest_ns
    row.since = datetime.fromtimestamp(since, tz=UTC)
    row.ready_at = datetime.fromtimestamp(ready_at, tz=UTC) if ready_at is not None else None


def clear(session: Session, host: str, paths: list[str]) -> None:
    if paths:
        session.execute(delete(DetectionWait).where(DetectionWait.host == host, DetectionWait.path.in_(paths)))


def load(session: Session, host: str) -> dict[str, tuple[int, float]]:
    """``host``'s waits: path -> (newest_ns, since as epoch seconds), for a watcher starting."""
    return {w.path: (w.newest_ns, w.since.timestamp())
            for w in session.scalars(select(DetectionWait).where(DetectionWait.host == host))}


def listed(session: Session, at: datetime, runs: list[str] | None = None, limit: int = 1000) -> list[dict[str, Any]]:
    """The entries waiting to be recorded, oldest wait first, with the seconds they waited and,
    for one waiting out its quiet period, the seconds left. Those also listed as a problem (stuck
    for a whole quiet period) are listed there instead."""
    q = (select(DetectionWait).order_by(DetectionWait.since, DetectionWait.id).limit(limit)
         .where(~select(DetectionProblem.id).where(DetectionProblem.host == DetectionWait.host,
                                                   DetectionProblem.path == DetectionWait.path).exists()))
    if runs is not None:
        q = q.where(DetectionWait.run.in_(runs))
    return [{"path": w.path, "run": w.run, "host": w.host or None, "reason": w.reason, "since": w.since,
             "waited_s": max(0.0, (at - w.since).total_seconds()),
             "left_s": max(0.0, (w.ready_at - at).total_seconds()) if w.ready_at is not None else None}
            for w in session.scalars(q)]
