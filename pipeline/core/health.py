"""Shard health, per replica and per shard. Pure (docs/design.md, section 5).

Per replica, from :func:`pipeline.core.copies.is_good`: ``verified`` (a good copy,
re-hashed within the freshness window), ``stale`` (a good copy, re-hashed longer ago),
``draining`` (a verified copy on a draining worker: readable, no longer counted),
``unverified`` (stored, not re-hashed since), ``corrupt``, ``missing`` (absent, or on a
worker that cannot be read), ``pending`` (not stored yet).
Per shard: ``healthy`` (RF good copies), ``under-replicated``, or ``lost`` (no good copy
and no local copy to rebuild from).
Per checkpoint, the one label every view shows (docs/design.md, section 3, "What every view says
of a checkpoint"): :func:`checkpoint_health` and :func:`local_copy`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from pipeline.core.copies import Copy, good_workers, is_good
from pipeline.states import READABLE_WORKERS, RETIRED, CopyState, Tier, WorkerState

#: Replica healths of a good copy: the ones a shard's health counts.
COUNTS = ("verified", "stale")


def replica_health(copy: Copy, fresh_after: datetime) -> str:
    """The health of one copy; ``fresh_after`` is now minus the freshness window."""
    if copy.state in (CopyState.CORRUPT, CopyState.MISSING):
        return str(copy.state)
    if copy.worker_state not in READABLE_WORKERS:
        return "missing"
    if is_good(copy, fresh_after):
        return "verified"
    if is_good(copy):
        return "stale"
    if copy.state == CopyState.VERIFIED and copy.worker_state == WorkerState.DRAINING:
        return "draining"
    if copy.state in (CopyState.STORED, CopyState.VERIFIED):
        return "unverified"
    return "pending"


#: When one worker's copy of a content has several rows (shared by several checkpoints) that
#: disagree, the first of these that any row shows is the copy's health.
_WORST_FIRST = ("corrupt", "missing", "draining", "unverified", "pending", "stale", "verified")


def worker_healths(copies: Iterable[Copy], fresh_after: datetime, tier: str = Tier.WORKERS) -> dict[str, str]:
    """Per worker of ``tier`` (storage workers: what a shard's health counts), the health of its
    copy of one content, from every row recorded for that content (of any checkpoint): the same
    answer for every checkpoint that shares it."""
    rows = [c for c in copies if c.state not in RETIRED and c.tier == tier]
    fresh, good = good_workers(rows, fresh_after, tier), good_workers(rows, tier=tier)
    out: dict[str, str] = {}
    for c in rows:
        if c.worker_id in fresh:
            out[c.worker_id] = "verified"
        elif c.worker_id in good:
            out[c.worker_id] = "stale"
        else:
            h = replica_health(c, fresh_after)
            if h in ("verified", "stale"):  # good alone, but another row of the content says otherwise
                h = "unverified"
            prev = out.get(c.worker_id)
            out[c.worker_id] = h if prev is None else min(prev, h, key=_WORST_FIRST.index)
    return dict(sorted(out.items()))


def shard_health(replicas: list[str], rf: int, local_copy: bool) -> str:
    """A shard's health from its copies' healths (one per worker)."""
    good = sum(1 for h in replicas if h in COUNTS)
    if good >= rf:
        return "healthy"
    if good == 0 and not local_copy:
        return "lost"
    return "under-replicated"


#: The health of a checkpoint that no longer holds its content (pipeline.states.RELEASED): it is
#: owed no copy, so no shard of it is lost or under-replicated, whatever its copies are now.
#: Forgotten (the remote retention policy, `ckpt forget`) and superseded ones say what they are;
#: a vanished one (its local copy deleted before it was protected) was never protected.
RELEASED_HEALTH: dict[str, str] = {"forgotten": "forgotten", "superseded": "superseded", "vanished": "unprotected"}
#: Checkpoint healths that call for a person (shown red or orange); the others are shown grey
#: or green.
ALARMING = ("lost", "under-replicated")


def checkpoint_health(state: str, shards: Mapping[str, int]) -> str:
    """The one health label of a checkpoint (or of one of its shards), used by ``ckpt status``,
    every page, the API and /metrics: from its store ``state`` and the count of its shards in
    each shard health (:func:`shard_health`; empty: no shard recorded yet)."""
    if state in RELEASED_HEALTH:
        return RELEASED_HEALTH[state]
    for h in ("lost", "under-replicated", "healthy"):
        if shards.get(h):
            return h
    return "unprotected"


#: Why a local copy is gone (``checkpoints.local_gone``), in words.
LOCAL_GONE = {"rotated": "rotated", "deleted": "deleted by the trainer", "replaced": "replaced"}


def local_copy(present: bool, gone: str | None) -> str:
    """What became of a checkpoint's local copy, from the evidence recorded when it went: our
    rotation ("rotated"), the watcher finding it deleted ("deleted by the trainer": its own
    rotation such as ``save_total_limit``, or a person), new content at its path ("replaced")."""
    if present:
        return "kept"
    return LOCAL_GONE.get(gone or "", "gone")
