"""Shard health, per replica and per shard. Pure (DESIGN section 5).

Per replica: ``verified`` (re-hash matched within the freshness window), ``stale`` (matched,
but longer ago), ``unverified`` (stored, never re-hashed), ``corrupt``, ``missing`` (absent,
or on a worker that is not live), ``pending`` (not stored yet).
Per shard: ``healthy`` (RF copies that count), ``under-replicated``, or ``lost`` (no copy
matches the manifest and no local copy to rebuild from).
"""
from __future__ import annotations

from datetime import datetime, timedelta

#: Worker states whose replicas can be read (a draining worker still serves its copies).
READABLE = ("up", "draining")
#: Replica healths that count as a copy of the shard.
COUNTS = ("verified", "stale")


def replica_health(state: str, verified_at: datetime | None, worker_state: str, now: datetime,
                   freshness_seconds: float) -> str:
    if state in ("corrupt", "missing"):
        return state
    if worker_state not in READABLE:
        return "missing"
    if state == "verified" and verified_at is not None:
        return "verified" if verified_at >= now - timedelta(seconds=freshness_seconds) else "stale"
    if state == "stored":
        return "unverified"
    return "pending"


def shard_health(replicas: list[str], rf: int, local_copy: bool) -> str:
    good = sum(1 for h in replicas if h in COUNTS)
    if good >= rf:
        return "healthy"
    if good == 0 and not local_copy:
        return "lost"
    return "under-replicated"
