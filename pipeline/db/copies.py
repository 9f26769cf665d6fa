"""Queries and updates of content and its copies, shared by the store steps, scrub, repair,
reconciliation, garbage collection and status.

:func:`good_copy` is the SQL form of :func:`pipeline.core.copies.is_good`, the one rule for
a copy that counts toward the replication factor (docs/design.md, section 3). :func:`move` is
the only code that changes a copy's state (and :func:`new_copy` the only one that creates a
copy): it follows :data:`pipeline.states.COPY_MOVES` and writes the columns each target implies,
so "re-hashed after it was stored" (``verified_at >= stored_at``) holds by construction.
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, Subquery, and_, case, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from pipeline.core import placement
from pipeline.core.copies import Copy, ShardCopies, good_workers
from pipeline.db.content_rf import RunRF
from pipeline.db.models import Checkpoint, CheckpointFile, Content, ContentCopy, Job, Shard, StorageWorker
from pipeline.db.transitions import latest_store_ids, now
from pipeline.errors import InvalidMove, PlacementError
from pipeline.states import (
    COUNTING_WORKERS,
    PLACEABLE_WORKERS,
    PLACED,
    PROTECTED,
    REUSABLE,
    SENT,
    ContentState,
    CopyState,
    Tier,
    copy_sources,
)


def good_copy(fresh_after: datetime | None = None, tier: str | None = Tier.WORKERS) -> ColumnElement[bool]:
    """SQL form of :func:`pipeline.core.copies.is_good`: true for a ``ContentCopy`` row (joined to
    its ``StorageWorker`` and ``Content``) that counts toward RF; with ``tier``, on that tier
    only (by default storage workers, what RF counts; None: any)."""
    cond = and_(
        StorageWorker.tier == tier if tier is not None else True,
        ContentCopy.state == CopyState.VERIFIED.value,
        StorageWorker.state.in_(sorted(COUNTING_WORKERS)),
        Content.state == ContentState.LIVE.value,
        ContentCopy.verified_at.is_not(None),
        ContentCopy.stored_at.is_not(None),
        ContentCopy.verified_at >= ContentCopy.stored_at,
    )
    return and_(cond, ContentCopy.verified_at >= fresh_after) if fresh_after is not None else cond


def fresh_after(freshness_seconds: float) -> datetime:
    """The oldest re-hash that still allows a deletion (now minus the freshness window)."""
    return now() - timedelta(seconds=freshness_seconds)


def copy_of(c: ContentCopy, content_state: str | None = None) -> Copy:
    return Copy(c.worker_id, c.state, c.worker.state, c.stored_at, c.verified_at,
                content_state or c.content.state, c.worker.tier)


def content_copies(session: Session, shas: Iterable[str]) -> dict[str, list[Copy]]:
    """Every copy of each content, as plain data."""
    out: dict[str, list[Copy]] = {sha: [] for sha in shas}
    if not out:
        return out
    rows = session.execute(
        select(ContentCopy.sha256, ContentCopy.worker_id, ContentCopy.state, StorageWorker.state,
               ContentCopy.stored_at, ContentCopy.verified_at, Content.state, StorageWorker.tier)
        .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .join(Content, Content.sha256 == ContentCopy.sha256)
        .where(ContentCopy.sha256.in_(list(out)))
        .order_by(ContentCopy.id)
    )
    for sha, worker_id, state, worker_state, stored_at, verified_at, content_state, tier in rows:
        out[sha].append(Copy(worker_id, state, worker_state, stored_at, verified_at, content_state, tier))
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


def shas_of(checkpoint_id: int) -> Select[str]:
    """SQL: the contents a checkpoint's shards reference (with repeats)."""
    return select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id)


def just(sha: str) -> Select[str]:
    """SQL: one content, where a selection of contents is asked for."""
    return select(Content.sha256).where(Content.sha256 == sha)


def contents_of(session: Session, checkpoint_id: int) -> list[Content]:
    """The distinct contents a checkpoint's shards reference."""
    return list(session.scalars(select(Content).where(Content.sha256.in_(shas_of(checkpoint_id)))
                                .order_by(Content.sha256)))


def on(worker_id: str, *shas: str) -> ColumnElement[bool]:
    """SQL: the copies of contents ``shas`` on ``worker_id`` (what :func:`move` is usually given)."""
    return and_(ContentCopy.worker_id == worker_id, ContentCopy.sha256.in_(shas))


def move(session: Session, where: ContentCopy | ColumnElement[bool], to: str, *, at: datetime | None = None,
         from_: Iterable[str] | None = None, rehashed_at: datetime | None = None, error: str | None = None) -> int:
    """Move the copies ``where`` selects (a row, or a condition) to state ``to``; how many moved.

    One ``UPDATE ... WHERE <where> AND state IN <sources>``: a copy in a state from which
    :data:`~pipeline.states.COPY_MOVES` has no move to ``to`` is left as it is (a compare-and-set:
    whatever moved it meanwhile has the last word). ``from_`` narrows the sources further.
    Raises :class:`~pipeline.errors.InvalidMove` for a move the table lacks: a target no state
    reaches, ``from_`` naming a state that cannot reach ``to``, or a loaded row whose state cannot.
    It writes the columns the target implies, with ``last_error = error`` (None clears it) and
    ``at`` (default now):

    - ``pending``: ``stored_at = verified_at = None``. From a retired row it is a new copy
      (placement): ``attempts = 0``. From a sent one it is the same copy sent again after a
      check found it missing: its attempts go on (they bound the resend loop), ``checked_at = at``.
    - ``stored``: the bytes were written: ``stored_at = checked_at = at``, ``verified_at = None``
      (nothing re-hashed them since).
    - ``verified``: ``verified_at = rehashed_at`` (when the matching re-hash was made; default
      ``at``), ``checked_at = at``; only a copy stored no later than that re-hash moves, so a
      verified copy always has ``stored_at <= verified_at``.
    - ``corrupt``, ``missing``: ``checked_at = at``.
    - ``abandoned``, ``deleting``: nothing else.
    """
    target = CopyState(to)
    sources = copy_sources(target)
    if not sources:
        raise InvalidMove("copy", "any state", target)
    if from_ is not None:
        narrowed = frozenset(CopyState(f) for f in from_)
        if not narrowed <= sources:
            raise InvalidMove("copy", ", ".join(sorted(narrowed - sources)), target)
        sources = narrowed
    if isinstance(where, ContentCopy):
        if where.state not in sources:
            raise InvalidMove(f"copy {where.id} of {where.sha256[:12]} on {where.worker_id}", where.state, target)
        where = ContentCopy.id == where.id
    t = at if at is not None else now()
    values: dict[str, Any] = {"state": target, "last_error": error}
    conds = [where, ContentCopy.state.in_(sorted(sources))]
    if target == CopyState.PENDING:
        retired = ContentCopy.state.in_(sorted(REUSABLE))
        values.update(stored_at=None, verified_at=None,
                      attempts=case((retired, 0), else_=ContentCopy.attempts),
                      checked_at=case((ContentCopy.state.in_(sorted(SENT)), t), else_=ContentCopy.checked_at))
    elif target == CopyState.STORED:
        values.update(stored_at=t, checked_at=t, verified_at=None)
    elif target == CopyState.VERIFIED:
        rehashed = rehashed_at if rehashed_at is not None else t
        values.update(verified_at=rehashed, checked_at=t)
        conds += [ContentCopy.stored_at.is_not(None), ContentCopy.stored_at <= rehashed]
    elif target in (CopyState.CORRUPT, CopyState.MISSING):
        values.update(checked_at=t)
    moved = list(session.scalars(update(ContentCopy).where(*conds).values(**values).returning(ContentCopy.id)
                                 .execution_options(synchronize_session=False)))
    for copy_id in moved:  # a row this session holds reads what the UPDATE wrote
        held = session.identity_map.get(identity_key(ContentCopy, copy_id))
        if held is not None:
            session.expire(held, list(values))
    return len(moved)


def new_copy(content: Content, worker_id: str) -> ContentCopy:
    """A new ``pending`` copy of ``content`` on ``worker_id`` (added to the content's copies)."""
    row = ContentCopy(sha256=content.sha256, worker_id=worker_id, state=CopyState.PENDING, attempts=0,
                      size=content.size)
    content.copies.append(row)
    return row


def shas_on(session: Session, worker_id: str, states: Iterable[str], after: str = "",
            limit: int | None = None) -> list[str]:
    """Hashes of the copies in ``states`` on ``worker_id``, in hash order after ``after``."""
    q = (select(ContentCopy.sha256).where(ContentCopy.worker_id == worker_id,
                                          ContentCopy.state.in_(sorted(states)), ContentCopy.sha256 > after)
         .order_by(ContentCopy.sha256))
    if limit:
        q = q.limit(limit)
    return list(session.scalars(q))


def live_candidates(session: Session, tier: str = Tier.WORKERS) -> list[placement.Candidate]:
    """The rows of ``tier`` placement may choose: up and below the high watermark (or quota)."""
    rows = session.scalars(select(StorageWorker).where(StorageWorker.state.in_(sorted(PLACEABLE_WORKERS)),
                                                       StorageWorker.tier == tier))
    return [placement.Candidate(w.id, w.free_bytes, w.zone) for w in rows]


def place(session: Session, content: Content, wanted: int, *, candidates: list[placement.Candidate] | None = None,
          tier: str = Tier.WORKERS) -> list[ContentCopy]:
    """New pending copies of ``content`` until it has ``wanted`` copies placed (pending, stored
    or verified) on counting rows of ``tier`` (storage workers, or object stores); returns the
    new ones.

    A worker that already holds a placed, damaged or deleting copy is never chosen again (one
    copy per worker); a reusable row (abandoned, trimmed) on a chosen worker is reused. Raises
    :class:`~pipeline.errors.PlacementError` when too few workers can take one.
    """
    rows = {c.worker_id: c for c in content.copies}
    counting = {w.id for w in session.scalars(select(StorageWorker).where(
        StorageWorker.state.in_(sorted(COUNTING_WORKERS)), StorageWorker.tier == tier))}
    have = sum(1 for c in rows.values() if c.state in PLACED and c.worker_id in counting)
    need = wanted - have
    if need <= 0:
        return []
    busy = frozenset(w for w, c in rows.items() if c.state not in REUSABLE)
    pool = live_candidates(session, tier) if candidates is None else candidates
    targets = placement.place(content.sha256, pool, need, exclude=busy)
    out = []
    for target in targets:
        row = rows.get(target)
        if row is None:
            row = new_copy(content, target)
        else:
            move(session, row, CopyState.PENDING)
        out.append(row)
    session.flush()
    return out


def placed_count(session: Session, sha: str, tier: str = Tier.WORKERS) -> int:
    """Copies of content ``sha`` placed (pending, stored or verified) on counting rows of
    ``tier``: what :func:`place` tops up to the replication factor, read without loading the content."""
    return int(session.scalar(
        select(func.count(ContentCopy.id)).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .where(ContentCopy.sha256 == sha, ContentCopy.state.in_(sorted(PLACED)), StorageWorker.tier == tier,
               StorageWorker.state.in_(sorted(COUNTING_WORKERS)))) or 0)


def place_one(session: Session, content: Content, tier: str = Tier.WORKERS) -> ContentCopy:
    """One more pending copy on a placeable row of ``tier`` that holds none (repair, replacements)."""
    busy = frozenset(c.worker_id for c in content.copies if c.state not in REUSABLE)
    target = placement.place(content.sha256, live_candidates(session, tier), 1, exclude=busy)[0]
    row = next((c for c in content.copies if c.worker_id == target), None)
    if row is None:
        row = new_copy(content, target)
    else:
        move(session, row, CopyState.PENDING)
    session.flush()
    return row


def good_copies_per_shard(checkpoints: ColumnElement[bool], tier: str = Tier.WORKERS) -> Subquery:
    """(cid, sid, n): per shard of the selected checkpoints, the rows of ``tier`` holding a good
    copy of its content. The count that RF is measured against (a deletion also asks freshness)."""
    selected = (select(CheckpointFile.checkpoint_id.label("cid"), Shard.id.label("sid"), Shard.sha256.label("sha"))
                .join(Shard, Shard.file_id == CheckpointFile.id).where(checkpoints)).subquery()
    good = (select(ContentCopy.sha256, ContentCopy.worker_id)
            .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .join(Content, Content.sha256 == ContentCopy.sha256)
            .where(ContentCopy.sha256.in_(select(selected.c.sha)), good_copy(tier=tier))).subquery()
    return (
        select(selected.c.cid, selected.c.sid, func.count(func.distinct(good.c.worker_id)).label("n"))
        .outerjoin(good, good.c.sha256 == selected.c.sha)
        .group_by(selected.c.cid, selected.c.sid)
    ).subquery()


def held_per_worker(session: Session, worker_ids: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
    """Per worker (or only ``worker_ids``: along the (worker, state) index), the contents it
    holds a sent copy of and their bytes."""
    # The copies' own sizes, along the (worker, state, size) index: no content looked up.
    q = (select(ContentCopy.worker_id, func.count(ContentCopy.id), func.coalesce(func.sum(ContentCopy.size), 0))
         .where(ContentCopy.state.in_(sorted(SENT))))
    if worker_ids is not None:
        q = q.where(ContentCopy.worker_id.in_(list(worker_ids)))
    rows = session.execute(q.group_by(ContentCopy.worker_id))
    return {worker_id: (int(n), int(size)) for worker_id, n, size in rows}


def good_count(session: Session, sha: str) -> int:
    """Workers holding a good copy of one content."""
    return int(session.scalar(
        select(func.count(ContentCopy.id))
        .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .join(Content, Content.sha256 == ContentCopy.sha256)
        .where(ContentCopy.sha256 == sha, good_copy())
    ) or 0)


def good_counts(session: Session, shas: Iterable[str]) -> dict[str, int]:
    """Workers holding a good copy, for many contents (absent: none).

    The rows are read by hash and judged by the Python form of the rule: with the rule in
    the WHERE clause, SQLite (without statistics) walked the copies by (worker, state) and
    read every copy on the worker for each batch (0.1 s per 500 hashes at 200k copies).
    """
    wanted, out = sorted(set(shas)), dict[str, int]()
    for i in range(0, len(wanted), 500):
        for sha, copies in content_copies(session, wanted[i:i + 500]).items():
            if n := len(good_workers(copies)):
                out[sha] = n
    return out


__all__ = ["PlacementError", "content_copies", "contents_of", "copy_of", "fresh_after", "good_copies_per_shard",
           "good_copy", "good_count", "good_counts", "held_per_worker", "live_candidates", "move", "new_copy", "on",
           "place", "place_one", "placed_count", "shard_copies", "shas_on"]


def short_without(session: Session, worker_id: str, wanted: int | RunRF,
                  tier: str | None = Tier.WORKERS) -> tuple[int, int, int]:
    """``(held, short, short_bytes)``: the live contents ``worker_id`` holds a sent copy of, and
    how many of them (and their bytes) have fewer than ``wanted`` good copies on other workers
    (of ``tier``, as :func:`good_copy`: None counts every tier).

    ``wanted`` = the runs' RF: what a drain still has to move, each content to its own RF
    (:meth:`RunRF.of_content`; 0 short: the worker is drained); ``wanted`` = 1: the contents of
    which it holds the only copy (removing it loses them)."""
    its_content = (select(ContentCopy.sha256, Content.size).join(Content, Content.sha256 == ContentCopy.sha256)
                   .where(ContentCopy.worker_id == worker_id, ContentCopy.state.in_(sorted(SENT)),
                          Content.state == ContentState.LIVE.value).subquery())
    elsewhere = (
        select(ContentCopy.sha256, func.count(ContentCopy.worker_id).label("n"))
        .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .join(Content, Content.sha256 == ContentCopy.sha256)
        .where(ContentCopy.sha256.in_(select(its_content.c.sha256)), ContentCopy.worker_id != worker_id,
               good_copy(tier=tier))
        .group_by(ContentCopy.sha256)
    ).subquery()
    held = int(session.scalar(select(func.count()).select_from(its_content)) or 0)
    short, size = session.execute(
        select(func.count(), func.coalesce(func.sum(its_content.c.size), 0))
        .select_from(its_content.outerjoin(elsewhere, elsewhere.c.sha256 == its_content.c.sha256))
        .where(func.coalesce(elsewhere.c.n, 0)
               < (wanted.of_content(its_content.c.sha256) if isinstance(wanted, RunRF) else wanted))).one()
    return held, int(short), int(size)


def short_contents(s: Session, rf: RunRF) -> list[str]:
    """Contents of protected checkpoints short of RF good copies: fewer than the RF of the run
    of a protected checkpoint that references them (so, short of the largest such RF)."""
    protected = select(Job.checkpoint_id).where(Job.id.in_(latest_store_ids()), Job.state.in_(sorted(PROTECTED)))
    per_shard = good_copies_per_shard(CheckpointFile.checkpoint_id.in_(protected))
    short = select(per_shard.c.sid)
    if rf.other:  # the RF of each shard's run (else a constant: no join)
        short = short.join(Checkpoint, Checkpoint.id == per_shard.c.cid)
    short = short.where(per_shard.c.n < rf.of_run())
    return list(s.scalars(select(Shard.sha256).where(Shard.id.in_(short)).distinct()))
