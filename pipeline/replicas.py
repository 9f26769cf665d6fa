"""Queries and updates of replicas shared by verify, scrub, repair and reconciliation."""
from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Subquery, func, select, update
from sqlalchemy.orm import Session

from pipeline import placement
from pipeline.db.models import CheckpointFile, Replica, Shard, StorageWorker

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


def live_candidates(session: Session) -> list[placement.Candidate]:
    """The storage workers placement may choose: those that are up."""
    rows = session.scalars(select(StorageWorker).where(StorageWorker.state == "up"))
    return [placement.Candidate(w.id, w.free_bytes, w.zone) for w in rows]


def place_replacement(session: Session, shard: Shard) -> Replica:
    """A new pending replica of ``shard`` on a live worker that never held a row for it.

    Raises :class:`~pipeline.errors.PlacementError` when no such worker is up.
    """
    holders = frozenset(r.worker_id for r in shard.replicas)  # one row per (shard, worker)
    target = placement.place(shard.sha256, live_candidates(session), 1, exclude=holders)[0]
    fresh = Replica(shard_id=shard.id, worker_id=target, state="pending")
    session.add(fresh)
    session.flush()
    return fresh


def good_copies_per_shard(checkpoints: ColumnElement[bool]) -> Subquery:
    """(cid, sid, n): per shard of the selected checkpoints, its verified copies on up workers.

    The count that RF is measured against (rotation adds freshness on top).
    """
    return (
        select(CheckpointFile.checkpoint_id.label("cid"), Shard.id.label("sid"),
               func.count(func.distinct(StorageWorker.id)).label("n"))
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .outerjoin(Replica, (Replica.shard_id == Shard.id) & (Replica.state == "verified"))
        .outerjoin(StorageWorker, (StorageWorker.id == Replica.worker_id) & (StorageWorker.state == "up"))
        .where(checkpoints)
        .group_by(CheckpointFile.checkpoint_id, Shard.id)
    ).subquery()
