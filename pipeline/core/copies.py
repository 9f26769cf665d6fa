"""Copies of a shard: which ones are good, and when a local checkpoint may be deleted. Pure.

**The one rule for a good copy** (docs/design.md, invariant 1): a copy counts toward the
replication factor when its worker's re-hash from disk matched the content's SHA-256
(state ``verified``) after the copy was stored, its worker counts (``up`` or ``full``: not
down, draining, rejected or removable), and its content is live (not condemned by garbage
collection). Deleting a local copy also needs every good copy to be *fresh*: re-hashed
within the freshness window. Content is the unit of storage: one copy per (content, worker),
shared by every checkpoint whose shards have that SHA-256, so they all see the same truth.
:func:`good_workers` is that rule; its SQL form is :func:`pipeline.db.copies.good_copy`, and
a test holds the two to the same answers.

Every place that asks "is this copy good?" goes through it: the rotation decision below,
the confirmation with the workers before a deletion, the replica counts of ``ckpt status``
and the scheduler's under-replication sweep (SQL form), shard health and repair planning.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from pipeline.states import COUNTING_WORKERS, DAMAGED, ContentState, CopyState, Tier


@dataclass(frozen=True)
class Copy:
    """One shard's copy on one worker, as plain data."""

    worker_id: str
    state: str
    worker_state: str
    stored_at: datetime | None = None
    verified_at: datetime | None = None
    #: The content's state: only a live content's copies count (a condemned one is being collected).
    content_state: str = "live"
    #: The tier of its worker row: a copy on an object store is good by the same rule, and is
    #: counted by the tier policy (:class:`Need`), never toward the workers' RF.
    tier: str = Tier.WORKERS.value


@dataclass(frozen=True)
class Need:
    """How many good copies of each content a run's checkpoints need before their local copy
    may go: ``rf`` on storage workers and ``targets`` on object stores (0 when the object-store
    copy may lag: it is made after ``verified``, and rotation does not wait for it)."""

    rf: int
    targets: int = 0


def is_good(copy: Copy, fresh_after: datetime | None = None) -> bool:
    """Whether one row's ``copy`` counts toward RF; with ``fresh_after``, also whether it
    was re-hashed at or after that time (what a deletion needs). :func:`good_workers`
    adds what the other rows of the same content say."""
    return (
        copy.state == CopyState.VERIFIED
        and copy.worker_state in COUNTING_WORKERS
        and copy.content_state == ContentState.LIVE
        and copy.verified_at is not None
        and copy.stored_at is not None
        and copy.verified_at >= copy.stored_at
        and (fresh_after is None or copy.verified_at >= fresh_after)
    )


def good_workers(copies: Iterable[Copy], fresh_after: datetime | None = None,
                 tier: str = Tier.WORKERS) -> frozenset[str]:
    """The distinct workers of ``tier`` (storage workers, by default: what RF counts) holding a
    good copy of one content, from every row recorded for that content (whichever checkpoint's
    shard it belongs to)."""
    rows = [c for c in copies if c.tier == tier]
    damaged = {c.worker_id for c in rows if c.state in DAMAGED}
    return frozenset(c.worker_id for c in rows if is_good(c, fresh_after) and c.worker_id not in damaged)


def short_of(shard: ShardCopies, need: Need, fresh_after: datetime | None = None) -> str | None:
    """What ``shard`` lacks of ``need`` ("1/2 ... on live workers"), or None."""
    n = len(good_workers(shard.copies, fresh_after))
    if n < need.rf:
        pinned = "; the local copy is pinned while the shard has no good replica" if n == 0 else ""
        return f"{shard.label} has {n}/{need.rf} fresh verified replicas on live workers{pinned}"
    t = len(good_workers(shard.copies, fresh_after, Tier.OBJECT_STORE))
    if t < need.targets:
        return f"{shard.label} has {t}/{need.targets} fresh confirmed copies on object stores"
    return None


@dataclass(frozen=True)
class ShardCopies:
    """One shard of a checkpoint with every copy recorded for its content (the rows of
    every shard, of any checkpoint, with the same SHA-256)."""

    label: str  # "shard 3 of model.safetensors", for messages
    sha256: str
    size: int
    copies: tuple[Copy, ...]


def deletion_blocker(
    shards: Sequence[ShardCopies],
    *,
    need: Need,
    fresh_after: datetime,
    active_job: int | None = None,
    changed: str | None = None,
) -> str | None:
    """Why the local copy of a checkpoint may not be deleted now, or None when it may.

    It may only when no other job is active on it (``active_job``), its local files are
    what was stored (``changed`` says what differs), it has a shard manifest, and every
    shard has good, fresh copies on at least ``need.rf`` distinct workers and ``need.targets``
    object stores. The workers and stores are then asked to confirm
    (:func:`confirmation_blocker`) before the deciding transaction.
    """
    if active_job is not None:
        return f"job {active_job} is still active on this checkpoint"
    if not shards:
        return "the checkpoint has no shard manifest"
    if changed:
        return f"{changed}; its new content is not protected yet"
    for shard in shards:
        if short := short_of(shard, need, fresh_after):
            return short
    return None


def to_confirm(shards: Sequence[ShardCopies], fresh_after: datetime, need: Need) -> dict[str, dict[str, int]]:
    """worker id -> {shard SHA-256: size} of the good, fresh copies each worker must confirm
    (an object store's only when ``need`` counts them)."""
    asks: dict[str, dict[str, int]] = {}
    for shard in shards:
        for c in shard.copies:
            if is_good(c, fresh_after) and (c.tier == Tier.WORKERS or need.targets):
                asks.setdefault(c.worker_id, {})[shard.sha256] = shard.size
    return asks


def confirmation_blocker(
    shards: Sequence[ShardCopies],
    answers: Mapping[str, Mapping[str, int | None] | str],
    *,
    need: Need,
    fresh_after: datetime,
) -> str | None:
    """Why the answers do not confirm ``need`` (RF copies on workers, ``targets`` on object
    stores) of every shard, or None.

    ``answers`` maps a worker id to the size it holds of each shard asked about (None:
    absent), or to the error text of a worker that could not answer (it confirms nothing).
    A copy is confirmed only if it is good and fresh here and its worker holds it at its size.
    """
    problems: list[str] = []
    for worker_id, reply in answers.items():
        if isinstance(reply, str):
            problems.append(f"worker {worker_id} could not confirm its replicas ({reply})")
    confirmed: dict[tuple[int, str], int] = {}
    for i, shard in enumerate(shards):
        for tier in Tier:
            confirmed[i, tier] = 0
            for worker_id in sorted(good_workers(shard.copies, fresh_after, tier)):
                answer: Mapping[str, int | None] | str | None = answers.get(worker_id)
                if answer is None or isinstance(answer, str):
                    continue
                held = answer.get(shard.sha256)
                if held == shard.size:
                    confirmed[i, tier] += 1
                else:
                    problems.append(f"worker {worker_id} no longer holds shard {shard.sha256[:12]} "
                                    f"(answered size {held})")
    for i, shard in enumerate(shards):
        for tier, wanted, where in ((Tier.WORKERS, need.rf, "the workers"), (Tier.OBJECT_STORE, need.targets,
                                                                             "the object stores")):
            if confirmed[i, tier] < wanted:
                why = "; ".join(problems[:3]) or "too few copies"
                return f"{shard.label} has {confirmed[i, tier]}/{wanted} copies confirmed by {where}: {why}"
    return None
