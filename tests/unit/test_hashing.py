"""Hashing a file for detection: its SHA-256 and its shards' (pipeline/hashing.py), in one
ordered read or from two places at once; the same answer either way."""
from __future__ import annotations

import hashlib
import os
import threading

import pytest

from pipeline import hashing
from pipeline.core.planner import ShardPlan


def _plans(cuts: list[int], headers: bool = False) -> list[ShardPlan]:
    """Shards covering ``[0, cuts[-1])`` cut at ``cuts``; with ``headers``, each carries one."""
    out, start = [], 0
    for i, end in enumerate(cuts):
        out.append(ShardPlan(seq=i, kind="safetensors" if headers else "raw", src_offset=start,
                             length=end - start, header=f"head{i}".encode() if headers else b""))
        start = end
    return out


def _expected(data: bytes, plans: list[ShardPlan]) -> tuple[str, list[str]]:
    return (hashlib.sha256(data).hexdigest(),
            [hashlib.sha256(p.header + data[p.src_offset:p.src_offset + p.length]).hexdigest() for p in plans])


@pytest.fixture(autouse=True)
def two_places_for_any_size(monkeypatch):
    """These files are small: hashed from two places all the same, unless a test says not."""
    monkeypatch.setattr(hashing, "TWO_PLACES_MIN_BYTES", 0)


def test_a_small_file_is_read_once_in_order_on_the_callers_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "TWO_PLACES_MIN_BYTES", 300_001)
    data = os.urandom(300_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    plans = _plans([100_000, 200_000, 300_000])
    told: list[tuple[int, str]] = []
    assert hashing.scan_from_two_places(
        path, plans, on_shard=lambda p, _sha: told.append((p.seq, threading.current_thread().name))) == \
        _expected(data, plans)
    assert told == [(0, threading.current_thread().name), (1, threading.current_thread().name),
                    (2, threading.current_thread().name)]


@pytest.mark.parametrize("cuts", [
    [100_000, 200_000],  # two shards: one per place
    [10_000, 20_000, 5_000_000, 9_000_000, 9_000_001, 12_000_000],  # uneven, a block-sized one, a 1-byte one
    [11_000_000, 11_500_000, 12_000_000],  # the middle falls in the first shard
    [500_000, 1_000_000, 12_000_000],  # the middle falls in the last shard
])
@pytest.mark.parametrize("headers", [False, True])
def test_two_places_give_the_answer_of_one_ordered_read_and_tell_each_shard_once(tmp_path, cuts, headers):
    data = os.urandom(cuts[-1])
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    plans = _plans(cuts, headers)
    told: list[tuple[int, str]] = []
    got = hashing.scan_from_two_places(path, plans, expected_size=len(data),
                                       on_shard=lambda p, sha: told.append((p.seq, sha)))
    assert got == _expected(data, plans) == hashing.scan(path, plans)
    assert sorted(told) == sorted(zip(range(len(plans)), got[1], strict=True))


def test_a_file_too_large_for_the_page_cache_is_read_once_in_order(tmp_path, monkeypatch):
    data = os.urandom(300_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    plans = _plans([100_000, 200_000, 300_000])
    monkeypatch.setattr(hashing, "available_memory", lambda: 4 * len(data) - 1)  # its second read might miss
    order: list[int] = []
    assert hashing.scan_from_two_places(path, plans, on_shard=lambda p, _sha: order.append(p.seq)) == \
        _expected(data, plans)
    assert order == [0, 1, 2]  # the ordered read
    monkeypatch.setattr(hashing, "available_memory", lambda: 4 * len(data))
    order.clear()
    assert hashing.scan_from_two_places(path, plans, on_shard=lambda p, _sha: order.append(p.seq)) == \
        _expected(data, plans)
    assert sorted(order) == [0, 1, 2]


def test_a_file_that_is_not_what_its_plan_says_is_refused(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(300_000))
    with pytest.raises(OSError, match="expected 400000"):
        hashing.scan_from_two_places(path, _plans([200_000, 400_000]), expected_size=400_000)
    with pytest.raises(OSError, match="covers 200000"):
        hashing.scan_from_two_places(path, _plans([100_000, 200_000]))
    gap = _plans([100_000, 300_000])
    gap[1] = ShardPlan(seq=1, kind="raw", src_offset=150_000, length=150_000)
    with pytest.raises(ValueError, match="starts at 150000"):
        hashing.scan_from_two_places(path, gap)
