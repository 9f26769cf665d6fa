"""Shard health, per replica and per shard. Pure (docs/design.md, section 5).

Per replica, from :func:`pipeline.core.copies.is_good`: ``verified`` (a good copy,
re-hashed within the freshness window), ``stale`` (a good copy, re-hashed longer ago),
``draining`` (a verified copy on a draining worker: readable, no longer counted),
``unverified`` (stored, not re-hashed since), ``corrupt``, ``missing`` (absent, or on a
worker that cannot be read), ``pending`` (not stored yet).
Per shard: ``healthy`` (RF good copies), ``under-replicated``, or ``lost`` (no good copy
and no local copy to rebuild from).
"""
from __future__ import annotations

from datetime import datetime

from pipeline.core.copies import Copy, is_good
from pipeline.states import READABLE_WORKERS, ReplicaState, WorkerState

#: Replica healths of a good copy: the ones a shard's health counts.
COUNTS = ("verified", "stale")


def replica_health(copy: Copy, fresh_after: datetime) -> str:
    """The health of one copy; ``fresh_after`` is now minus the freshness window."""
    if copy.state in (ReplicaState.CORRUPT, ReplicaState.MISSING):
        return str(copy.state)
    if copy.worker_state not in READABLE_WORKERS:
        return "missing"
    if is_good(copy, fresh_after):
        return "verified"
    if is_good(copy):
        return "stale"
    if copy.state == ReplicaState.VERIFIED and copy.worker_state == WorkerState.DRAINING:
        return "draining"
    if copy.state in (ReplicaState.STORED, ReplicaState.VERIFIED):
        return "unverified"
    return "pending"


def shard_health(replicas: list[str], rf: int, local_copy: bool) -> str:
    """A shard's health from its copies' healths (one per worker)."""
    good = sum(1 for h in replicas if h in COUNTS)
    if good >= rf:
        return "healthy"
    if good == 0 and not local_copy:
        return "lost"
    return "under-replicated"
