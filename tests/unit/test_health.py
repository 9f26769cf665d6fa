"""Shard health rules, and the scrub read throttle."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pipeline.core.copies import Copy
from pipeline.core.health import replica_health, shard_health
from workers.shardstore import Throttle

NOW = datetime(2026, 11, 21, tzinfo=UTC)


@pytest.mark.parametrize("state,age_days,worker,expected", [
    ("verified", 0.5, "up", "verified"),
    ("verified", 3, "up", "stale"),
    ("verified", 0.5, "down", "missing"),
    # Readable, but a draining worker's copies no longer count (pipeline.core.copies).
    ("verified", 0.5, "draining", "draining"),
    ("stored", None, "up", "unverified"),
    ("corrupt", 0.1, "up", "corrupt"),
    ("missing", None, "up", "missing"),
    ("pending", None, "up", "pending"),
])
def test_replica_health(state, age_days, worker, expected):
    verified_at = NOW - timedelta(days=age_days) if age_days is not None else None
    stored_at = NOW - timedelta(days=4) if state != "pending" else None
    copy = Copy("w-1", state, worker, stored_at, verified_at)
    assert replica_health(copy, NOW - timedelta(days=2)) == expected


def test_a_copy_verified_before_it_was_stored_is_unverified():
    copy = Copy("w-1", "verified", "up", stored_at=NOW, verified_at=NOW - timedelta(seconds=1))
    assert replica_health(copy, NOW - timedelta(days=2)) == "unverified"


@pytest.mark.parametrize("replicas,local,expected", [
    (["verified", "verified"], False, "healthy"),
    (["verified", "stale"], False, "healthy"),
    (["verified", "corrupt"], False, "under-replicated"),
    (["missing", "corrupt"], True, "under-replicated"),
    (["missing", "corrupt"], False, "lost"),
    ([], False, "lost"),
])
def test_shard_health(replicas, local, expected):
    assert shard_health(replicas, 2, local) == expected


def test_throttle_sleeps_to_hold_the_rate():
    clock = [0.0]
    slept = []

    def sleep(d: float) -> None:
        slept.append(d)
        clock[0] += d

    t = Throttle(100.0, clock=lambda: clock[0], sleep=sleep)
    for _ in range(10):
        t.consume(50)  # 500 bytes at 100 B/s: 5 s
    assert clock[0] == pytest.approx(5.0)
    unthrottled = Throttle(0, clock=lambda: 0.0, sleep=lambda d: slept.append(-1))
    unthrottled.consume(10**9)
    assert -1 not in slept


def test_health_is_per_content_and_worker_whatever_checkpoint_recorded_the_row():
    """Checkpoint A's row of content S on w1 says verified; B's row of S on w1 says corrupt:
    the copy on w1 is corrupt for both. A good copy recorded by B on w2 counts for A."""
    from pipeline.core.health import worker_healths

    stored, verified = NOW - timedelta(days=1), NOW - timedelta(hours=1)
    rows = [Copy("w1", "verified", "up", stored, verified), Copy("w1", "corrupt", "up", stored, verified),
            Copy("w2", "verified", "up", stored, verified), Copy("w3", "pending", "up")]
    cells = worker_healths(rows, NOW - timedelta(days=2))
    assert cells == {"w1": "corrupt", "w2": "verified", "w3": "pending"}
    assert shard_health(list(cells.values()), 2, local_copy=False) == "under-replicated"
    cells = worker_healths(rows + [Copy("w3", "verified", "up", stored, verified)], NOW - timedelta(days=2))
    assert shard_health(list(cells.values()), 2, local_copy=False) == "healthy"
