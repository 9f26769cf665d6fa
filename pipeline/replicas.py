"""Queries and updates of replicas shared by verify, scrub, repair and reconciliation."""
from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from pipeline.db.models import Replica, Shard

#: Replica states that stand for a file the worker should hold.
HELD = ("stored", "verified", "corrupt", "missing")


def mark(session: Session, worker_id: str, sha256: str, states: tuple[str, ...] = HELD, **values: Any) -> int:
    """Set ``values`` on every replica of content ``sha256`` on ``worker_id``.

    Shards are content-addressed and deduplicated: one file on a worker may stand for
    replicas of several checkpoints, and they share its fate.
    """
    ids = select(Replica.id).join(Shard).where(Replica.worker_id == worker_id, Shard.sha256 == sha256,
                                               Replica.state.in_(states))
    return session.execute(
        update(Replica).where(Replica.id.in_(ids)).values(**values).execution_options(synchronize_session=False)
    ).rowcount


def shas_on(session: Session, worker_id: str, states: tuple[str, ...], after: str = "", limit: int | None = None) -> list[str]:
    """Distinct shard hashes with a replica in ``states`` on ``worker_id``, in hash order after ``after``."""
    q = (select(Shard.sha256).join(Replica).where(Replica.worker_id == worker_id, Replica.state.in_(states),
                                                  Shard.sha256 > after)
         .group_by(Shard.sha256).order_by(Shard.sha256))
    if limit:
        q = q.limit(limit)
    return list(session.scalars(q))
