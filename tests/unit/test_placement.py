"""Placement by weighted rendezvous hashing."""
from __future__ import annotations

from collections import Counter

import pytest

from pipeline.core.placement import Candidate, GiB, place
from pipeline.errors import PlacementError

W = [Candidate(f"w{i}", 100 * GiB) for i in range(5)]
SHARDS = [f"{i:064x}" for i in range(2000)]


def test_replicas_go_to_distinct_workers():
    for s in SHARDS[:200]:
        chosen = place(s, W, 3)
        assert len(set(chosen)) == 3


def test_placement_is_deterministic():
    assert [place(s, W, 2) for s in SHARDS[:50]] == [place(s, list(reversed(W)), 2) for s in SHARDS[:50]]


def test_losing_a_worker_moves_only_its_shards():
    before = {s: place(s, W, 2) for s in SHARDS}
    after = {s: place(s, W[:-1], 2) for s in SHARDS}
    for s in SHARDS:
        if "w4" not in before[s]:
            assert after[s] == before[s]
        else:
            kept = [w for w in before[s] if w != "w4"]
            assert kept[0] in after[s]


def test_free_space_weights_the_share():
    ws = [Candidate("big", 900 * GiB), Candidate("small", 100 * GiB), Candidate("mid", 300 * GiB)]
    firsts = Counter(place(s, ws, 1)[0] for s in SHARDS)
    assert firsts["big"] > firsts["mid"] > firsts["small"]


def test_zones_are_spread_when_known():
    ws = [Candidate("a1", GiB, "a"), Candidate("a2", GiB, "a"), Candidate("b1", GiB, "b")]
    for s in SHARDS[:200]:
        zones = {w[0] for w in place(s, ws, 2)}
        assert zones == {"a", "b"}


def test_too_few_workers_is_a_clear_error():
    with pytest.raises(PlacementError, match="need 3 distinct live storage workers, have 2"):
        place(SHARDS[0], W[:2], 3)


def test_excluded_workers_are_never_chosen():
    for s in SHARDS[:100]:
        assert "w0" not in place(s, W, 2, exclude=frozenset({"w0"}))
