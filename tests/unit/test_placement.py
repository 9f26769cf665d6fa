"""Placement by weighted rendezvous hashing."""
from __future__ import annotations

from collections import Counter

import pytest

from pipeline.core.placement import Candidate, GiB, chain_orders, place
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


def test_chain_first_hops_share_the_hosts_bytes_evenly():
    """A checkpoint's contents placed by rendezvous on four workers: each worker is the first
    hop (what the host sends to) for about a quarter of the bytes, not rendezvous order's luck."""
    workers = [Candidate(f"w-{i}", 100 * GiB) for i in range(4)]
    contents = [(64, place(f"{i:064x}", workers, 2)) for i in range(64)]
    orders = chain_orders(contents)
    assert all(sorted(o) == sorted(ws) for o, (_s, ws) in zip(orders, contents, strict=True))
    firsts = Counter(o[0] for o in orders)
    assert set(firsts) == {w.id for w in workers}
    assert all(abs(n - 16) <= 1 for n in firsts.values()), firsts  # a quarter each, within one content
    luck = Counter(ws[0] for _s, ws in contents)  # rendezvous order's first, for comparison
    assert max(luck.values()) - min(luck.values()) > max(firsts.values()) - min(firsts.values()), luck


def test_chain_first_hops_alternate_and_weigh_by_size():
    assert [o[0] for o in chain_orders([(10, ["a", "b"])] * 4)] == ["a", "b", "a", "b"]
    # a big content makes its first hop "busy" for that many bytes
    assert [o[0] for o in chain_orders([(100, ["a", "b"]), (10, ["a", "b"]), (10, ["a", "b"])])] == ["a", "b", "b"]
    assert chain_orders([(5, ["x"]), (5, [])]) == [["x"], []]


def test_chain_hops_after_the_first_go_to_the_worker_receiving_least():
    orders = chain_orders([(10, ["a", "b", "c"]), (10, ["a", "b", "c"]), (10, ["a", "b", "c"])])
    assert [o[0] for o in orders] == ["a", "b", "c"]
    assert all(len(set(o)) == 3 for o in orders)
