"""The one rule for a good copy, and the rotation decision built on it (pure, plain rows).

Given copies of every shard, When the decision is asked, Then it deletes only with RF good,
fresh copies per shard, and says why not otherwise. The SQL form of the rule is held to
the same answers as the Python form on random rows, on SQLite and PostgreSQL.
"""
from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select

from pipeline.core.copies import (
    Copy,
    Need,
    ShardCopies,
    confirmation_blocker,
    deletion_blocker,
    good_workers,
    is_good,
    to_confirm,
)
from pipeline.db.copies import good_copy, shard_copies
from pipeline.db.models import Checkpoint, CheckpointFile, Content, ContentCopy, Shard, StorageWorker
from pipeline.states import ContentState, CopyState, WorkerState

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
FRESH = NOW - timedelta(days=2)  # the freshness window's start
STORED = NOW - timedelta(days=1)
SHA = "ab" * 32


def good(worker: str, *, verified: datetime = NOW, stored: datetime = STORED, state: str = "verified",
         worker_state: str = "up") -> Copy:
    return Copy(worker, state, worker_state, stored, verified)


def shard(*copies: Copy, sha: str = SHA, size: int = 100, label: str = "shard 1 of m.safetensors") -> ShardCopies:
    return ShardCopies(label, sha, size, tuple(copies))


def decide(*shards: ShardCopies, rf: int = 2, **kw) -> str | None:
    return deletion_blocker(list(shards), need=Need(rf), fresh_after=FRESH, **kw)


def test_rf_good_fresh_copies_allow_deletion():
    assert decide(shard(good("w1"), good("w2"))) is None


def test_fewer_than_rf_good_copies_block_and_say_which_shard():
    reason = decide(shard(good("w1")))
    assert reason == "shard 1 of m.safetensors has 1/2 fresh verified replicas on live workers"


def test_freshness_boundary_is_inclusive():
    long_ago = FRESH - timedelta(days=1)
    at_edge = good("w1", stored=long_ago, verified=FRESH)
    assert decide(shard(at_edge, good("w2", stored=long_ago, verified=FRESH))) is None
    just_stale = good("w2", stored=long_ago, verified=FRESH - timedelta(microseconds=1))
    assert "1/2" in decide(shard(at_edge, just_stale))


def test_a_copy_verified_before_it_was_stored_does_not_count():
    early = good("w2", stored=NOW - timedelta(hours=1), verified=NOW - timedelta(hours=2))
    assert "1/2" in decide(shard(good("w1"), early))
    same_instant = good("w2", stored=STORED, verified=STORED)
    assert decide(shard(good("w1"), same_instant)) is None


@pytest.mark.parametrize("worker_state", ["down", "draining", "rejected", "removable", "candidate"])
def test_copies_on_a_worker_that_does_not_count_block(worker_state):
    assert "1/2" in decide(shard(good("w1"), good("w2", worker_state=worker_state)))


@pytest.mark.parametrize("state", ["pending", "stored", "corrupt", "missing", "abandoned", "trimmed"])
def test_copies_not_verified_do_not_count(state):
    assert "1/2" in decide(shard(good("w1"), good("w2", state=state)))


def test_no_replicas_pins_the_local_copy():
    reason = decide(shard())
    assert "0/2" in reason and "pinned" in reason


def test_no_manifest_blocks():
    assert decide() == "the checkpoint has no shard manifest"


def test_an_active_job_blocks_before_anything_else():
    assert decide(shard(good("w1"), good("w2")), active_job=7) == "job 7 is still active on this checkpoint"


def test_a_local_change_blocks():
    reason = decide(shard(good("w1"), good("w2")), changed="m.safetensors changed after it was stored")
    assert reason.startswith("m.safetensors changed after it was stored") and "not protected" in reason


def test_two_rows_on_one_worker_count_once():
    # Content shared by two shards (or two checkpoints) on one worker is one copy.
    assert "1/2" in decide(shard(good("w1"), good("w1")))


def test_content_shared_by_several_checkpoints_sees_one_truth():
    # Checkpoint A's row for content S on w1 is verified; checkpoint B's verify found the
    # same file on w1 corrupt. The file is the same: it is not a good copy for A either.
    a_row, b_row = good("w1"), good("w1", state="corrupt")
    assert "1/2" in decide(shard(a_row, b_row, good("w2")))
    # A good row of B (same content, other worker) counts for A.
    assert decide(shard(good("w1"), good("w2", state="pending"), good("w2"))) is None


def test_every_shard_needs_rf():
    ok = shard(good("w1"), good("w2"), sha="01" * 32)
    short = shard(good("w1"), sha="02" * 32, label="shard 2 of m.safetensors")
    assert decide(ok, short).startswith("shard 2 of m.safetensors has 1/2")


def test_rf_three():
    assert "2/3" in decide(shard(good("w1"), good("w2")), rf=3)
    assert decide(shard(good("w1"), good("w2"), good("w3")), rf=3) is None


def test_confirmation_asks_only_good_fresh_copies_and_needs_rf_answers():
    shards = [shard(good("w1"), good("w2"), good("w3", verified=FRESH - timedelta(days=1)))]
    assert to_confirm(shards, FRESH, Need(2)) == {"w1": {SHA: 100}, "w2": {SHA: 100}}
    assert confirmation_blocker(shards, {"w1": {SHA: 100}, "w2": {SHA: 100}}, need=Need(2), fresh_after=FRESH) is None
    wrong_size = confirmation_blocker(shards, {"w1": {SHA: 100}, "w2": {SHA: 99}}, need=Need(2), fresh_after=FRESH)
    assert "1/2 copies confirmed" in wrong_size and "no longer holds shard" in wrong_size
    unreachable = confirmation_blocker(shards, {"w1": {SHA: 100}, "w2": "connection refused"}, need=Need(2),
                                       fresh_after=FRESH)
    assert "could not confirm" in unreachable


# -- property: never "safe" with fewer than RF good copies ---------------------------------

times = st.sampled_from([None, FRESH - timedelta(days=1), FRESH, STORED, NOW])
copies = st.builds(Copy, st.sampled_from(["w1", "w2", "w3", "w4"]), st.sampled_from(list(CopyState)),
                   st.sampled_from(list(WorkerState)), times, times, st.sampled_from(list(ContentState)))
# A content has at most one copy per worker (copies are unique on content and worker), and a
# worker has one state: rows that contradict either describe no database.
shard_lists = st.lists(st.builds(lambda cs, i: shard(*cs, sha=f"{i:064x}"),
                                 st.lists(copies, max_size=4, unique_by=lambda c: c.worker_id),
                                 st.integers(0, 3)), max_size=4)


@settings(max_examples=400, deadline=None)
@given(shard_lists, st.integers(1, 3), st.none() | st.integers(1, 9), st.none() | st.just("f changed"))
def test_never_safe_with_fewer_than_rf_good_fresh_copies(shards, rf, active, changed):
    verdict = deletion_blocker(shards, need=Need(rf), fresh_after=FRESH, active_job=active, changed=changed)
    if verdict is None:
        assert shards and active is None and changed is None
        for sh in shards:
            workers = {c.worker_id for c in sh.copies if is_good(c, FRESH)
                       and not any(o.worker_id == c.worker_id and o.state in ("corrupt", "missing")
                                   for o in sh.copies)}
            assert len(workers) >= rf
            assert all(c.state == "verified" and c.worker_state in ("up", "full") and c.content_state == "live"
                       for c in sh.copies if c.worker_id in workers)
    else:
        assert isinstance(verdict, str) and verdict


@settings(max_examples=200, deadline=None)
@given(shard_lists, st.integers(1, 3))
def test_confirmed_by_every_worker_is_still_never_safe_below_rf(shards, rf):
    answers = {w: dict.fromkeys(sizes, 100) for w, sizes in to_confirm(shards, FRESH, Need(rf)).items()}
    verdict = confirmation_blocker(shards, answers, need=Need(rf), fresh_after=FRESH)
    if verdict is None:
        assert all(len(good_workers(sh.copies, FRESH)) >= rf for sh in shards)


# -- the SQL form agrees with the Python form ----------------------------------------------

rows = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["w1", "w2", "w3"]), st.sampled_from(list(CopyState)),
                          times, times), max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows, st.sampled_from(list(WorkerState)), st.booleans(), st.sampled_from(list(ContentState)))
def test_sql_form_of_the_rule_agrees_with_the_python_form(db, data, w3_state, fresh, second_content):
    """Random copy rows of two contents, each referenced by a shard of two checkpoints: the
    workers the SQL form calls good, per content, are the Python form's."""
    from pipeline.db.engine import session_scope

    since = FRESH if fresh else None
    with session_scope(db.db_url) as s:
        for table in (ContentCopy, Shard, CheckpointFile, Checkpoint, Content, StorageWorker):
            s.execute(delete(table))
        for k, state in ((0, ContentState.LIVE), (1, second_content)):
            s.add(Content(sha256=f"{k:064x}", size=1, state=state, created_at=NOW, last_referenced_at=NOW))
        for wid, state in (("w1", "up"), ("w2", "draining"), ("w3", w3_state)):
            s.add(StorageWorker(id=wid, url=f"http://127.0.0.1:1/{wid}", source="static", state=state))
        for c in range(2):  # two checkpoints; shard k of each has the same content
            ck = Checkpoint(path=f"/r/c{c}", run="/r", name=f"c{c}", is_dir=False, version=f"{c}", mtime=0,
                            total_bytes=1)
            s.add(ck)
            s.flush()
            f = CheckpointFile(checkpoint_id=ck.id, relpath="", size=1, sha256="0" * 64, format="opaque", mtime_ns=0)
            s.add(f)
            s.flush()
            for k in range(2):
                s.add(Shard(file_id=f.id, seq=k, kind="raw", sha256=f"{k:064x}", size=1, src_offset=0, length=1))
        seen = set()
        for k, wid, state, stored, verified in data:
            if (k, wid) in seen:
                continue  # one copy per (content, worker)
            seen.add((k, wid))
            s.add(ContentCopy(sha256=f"{k:064x}", worker_id=wid, state=state, stored_at=stored, verified_at=verified))
        s.flush()
        sql = {(sha, w) for sha, w in s.execute(
            select(ContentCopy.sha256, ContentCopy.worker_id)
            .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .join(Content, Content.sha256 == ContentCopy.sha256).where(good_copy(since)))}
        ckpt = s.scalar(select(Checkpoint.id).where(Checkpoint.name == "c0"))
        python = {(sc.sha256, w) for sc in shard_copies(s, ckpt) for w in good_workers(sc.copies, since)}
    assert sql == python


def on_store(name: str, **kw) -> Copy:
    return dataclasses.replace(good(f"target:{name}", **kw), tier="objectstore")


def test_a_copy_on_an_object_store_never_counts_toward_the_workers_rf():
    one_and_store = shard(good("w1"), on_store("s3"))
    assert good_workers(one_and_store.copies) == {"w1"}
    assert "1/2 fresh verified replicas" in deletion_blocker([one_and_store], need=Need(2), fresh_after=FRESH)
    # Required on the store: RF 1 on workers plus the store's copy.
    assert deletion_blocker([one_and_store], need=Need(1, 1), fresh_after=FRESH) is None
    blocked = deletion_blocker([shard(good("w1"), good("w2"))], need=Need(2, 1), fresh_after=FRESH)
    assert "0/1 fresh confirmed copies on object stores" in blocked
    stale = shard(good("w1"), on_store("s3", verified=FRESH - timedelta(seconds=1)))
    assert "object stores" in deletion_blocker([stale], need=Need(1, 1), fresh_after=FRESH)


def test_the_object_store_confirms_only_when_the_policy_requires_its_copy():
    both = [shard(good("w1"), on_store("s3"))]
    assert set(to_confirm(both, FRESH, Need(1))) == {"w1"}
    assert set(to_confirm(both, FRESH, Need(1, 1))) == {"w1", "target:s3"}
    answers = {"w1": {SHA: 100}, "target:s3": "object store s3: unreachable"}
    verdict = confirmation_blocker(both, answers, need=Need(1, 1), fresh_after=FRESH)
    assert verdict is not None and "0/1 copies confirmed by the object stores" in verdict
    assert confirmation_blocker(both, {"w1": {SHA: 100}, "target:s3": {SHA: 100}}, need=Need(1, 1),
                                fresh_after=FRESH) is None
