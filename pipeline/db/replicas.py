"""Queries and updates of replicas shared by the store steps, scrub, repair and reconciliation.

:func:`good_copy` is the SQL form of :func:`pipeline.core.copies.is_good`, the one rule for
a copy that counts toward the replication factor.
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Subquery, and_, func, select, update
from sqlalchemy.orm import Session, aliased

from pipeline.core import placement
from pipeline.core.copies import Copy, ShardCopies
from pipeline.db.engine import rowcount
from pipeline.db.models import Checkpoint, CheckpointFile, Replica, Shard, StorageWorker
from pipeline.db.transitions import now
from pipeline.states import COUNTING_WORKERS, DAMAGED, HELD, ReplicaState


def good_copy(fresh_after: datetime | None = None) -> ColumnElement[bool]:
    """SQL form of :func:`pipeline.core.copies.good_workers`: true for a ``Replica`` row
    (joined to its ``Shard`` and ``StorageWorker``) whose copy counts toward RF."""
    other, other_shard = aliased(Replica), aliased(Shard)
    damaged_elsewhere = (
        select(other.id).join(other_shard, other_shard.id == other.shard_id)
        .where(other.worker_id == Replica.worker_id, other_shard.sha256 == Shard.sha256,
               other.state.in_(sorted(DAMAGED)))
        .exists()
    )
    cond = and_(
        Replica.state == ReplicaState.VERIFIED.value,
        StorageWorker.state.in_(sorted(COUNTING_WORKERS)),
        Replica.verified_at.is_not(None),
        Replica.stored_at.is_not(None),
        Replica.verified_at >= Replica.stored_at,
        ~damaged_elsewhere,
    )
    return and_(cond, Replica.verified_at >= fresh_after) if fresh_after is not None else cond


def fresh_after(freshness_seconds: float) -> datetime:
    """The oldest re-hash that still allows a deletion (now minus the freshness window)."""
    return now() - timedelta(seconds=freshness_seconds)


def copy_of(rep: Replica) -> Copy:
    return Copy(rep.worker_id, rep.state, rep.worker.state, rep.stored_at, rep.verified_at)


def content_copies(session: Session, shas: Iterable[str]) -> dict[str, list[Copy]]:
    """Every copy row of each content (any checkpoint's shard with that SHA-256), as plain data."""
    out: dict[str, list[Copy]] = {sha: [] for sha in shas}
    if not out:
        return out
    rows = session.execute(
        select(Shard.sha256, Replica.worker_id, Replica.state, StorageWorker.state, Replica.stored_at,
               Replica.verified_at)
        .join(Replica, Replica.shard_id == Shard.id)
        .join(StorageWorker, StorageWorker.id == Replica.worker_id)
        .where(Shard.sha256.in_(list(out)))
        .order_by(Replica.id)
    )
    for sha, worker_id, state, worker_state, stored_at, verified_at in rows:
        out[sha].append(Copy(worker_id, state, worker_state, stored_at, verified_at))
    return out


def shard_copies(session: Session, checkpoint_id: int) -> list[ShardCopies]:
    """Every shard of a checkpoint with every copy of its content, as plain data (manifest order)."""
    ckpt = session.get(Checkpoint, checkpoint_id)
    name = ckpt.name if ckpt is not None else "the file"
    shards = session.execute(
        select(CheckpointFile.relpath, Shard.seq, Shard.sha256, Shard.size)
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .where(CheckpointFile.checkpoint_id == checkpoint_id)
        .order_by(CheckpointFile.relpath, Shard.seq)
    ).all()
    by_content = content_copies(session, {sha for _rel, _seq, sha, _size in shards})
    return [ShardCopies(f"shard {seq} of {rel or name}", sha, size, tuple(by_content[sha]))
            for rel, seq, sha, size in shards]


def mark(session: Session, worker_id: str, sha256: str, states: Iterable[str] = HELD, **values: Any) -> int:
    """Set ``values`` on every replica of content ``sha256`` on ``worker_id``.

    Shards are content-addressed and deduplicated: one file on a worker may stand for
    replicas of several checkpoints, and they share its fate.
    """
    ids = select(Replica.id).join(Shard).where(Replica.worker_id == worker_id, Shard.sha256 == sha256,
                                               Replica.state.in_(sorted(states)))
    result = session.execute(
        update(Replica).where(Replica.id.in_(ids)).values(**values).execution_options(synchronize_session=False)
    )
    return rowcount(result)


def shas_on(session: Session, worker_id: str, states: Iterable[str], after: str = "",
            limit: int | None = None) -> list[str]:
    """Distinct shard hashes with a replica in ``states`` on ``worker_id``, in hash order after ``after``."""
    q = (select(Shard.sha256).join(Replica).where(Replica.worker_id == worker_id, Replica.state.in_(sorted(states)),
                                                  Shard.sha256 > after)
         .group_by(Shard.sha256).order_by(Shard.sha256))
    if limit:
        q = q.limit(limit)
    return list(session.scalars(q))


def live_candidates(session: Session) -> list[placement.Candidate]:
    """The storage workers placement may choose: those whose copies count."""
    rows = session.scalars(select(StorageWorker).where(StorageWorker.state.in_(sorted(COUNTING_WORKERS))))
    return [placement.Candidate(w.id, w.free_bytes, w.zone) for w in rows]


def place_replacement(session: Session, shard: Shard) -> Replica:
    """A new pending replica of ``shard`` on a live worker that never held a row for it.

    Raises :class:`~pipeline.errors.PlacementError` when no such worker is up.
    """
    holders = frozenset(r.worker_id for r in shard.replicas)  # one row per (shard, worker)
    target = placement.place(shard.sha256, live_candidates(session), 1, exclude=holders)[0]
    fresh = Replica(shard_id=shard.id, worker_id=target, state=ReplicaState.PENDING.value)
    session.add(fresh)
    session.flush()
    return fresh


def good_copies_per_shard(checkpoints: ColumnElement[bool]) -> Subquery:
    """(cid, sid, n): per shard of the selected checkpoints, the workers holding a good copy.

    The count that RF is measured against (a deletion also asks for freshness). Copies
    are of content: a good copy recorded under another checkpoint's shard with the same
    SHA-256 counts too (it is the same file on that worker).
    """
    selected = (select(CheckpointFile.checkpoint_id.label("cid"), Shard.id.label("sid"), Shard.sha256.label("sha"))
                .join(Shard, Shard.file_id == CheckpointFile.id).where(checkpoints)).subquery()
    good = (select(Shard.sha256, Replica.worker_id)
            .join(Replica, Replica.shard_id == Shard.id)
            .join(StorageWorker, StorageWorker.id == Replica.worker_id)
            .where(Shard.sha256.in_(select(selected.c.sha)), good_copy())).subquery()
    return (
        select(selected.c.cid, selected.c.sid, func.count(func.distinct(good.c.worker_id)).label("n"))
        .outerjoin(good, good.c.sha256 == selected.c.sha)
        .group_by(selected.c.cid, selected.c.sid)
    ).subquery()
