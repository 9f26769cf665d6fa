"""Content is the unit of storage: every checkpoint sharing a content sees the same copies,
and garbage collection never condemns content a kept checkpoint references.

On SQLite and PostgreSQL. The regressions of the per-checkpoint replica model are here: a
corrupt copy seen through B counts for A, two reconciles never both trim one surplus, two
repairs of one content never both run, a lost repair never blocks rotation once the content
recovered. And the mark's race with a store deduplicating onto the content it condemns.
"""
from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from pipeline.core.copies import Need, deletion_blocker, is_good
from pipeline.db.copies import content_copies, fresh_after, place, shard_copies
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Content, ContentCopy, Job, Shard, StorageWorker
from pipeline.db.transitions import create_job, now, transition
from pipeline.detection.catalog import reference
from pipeline.integrity import gc, retention
from pipeline.integrity.reconcile import _trim_if_surplus
from pipeline.integrity.repair import request_repair
from pipeline.store import sharding
from pipeline.store.rotation import unsafe_reason
from tests.unit.test_sharding import detected  # noqa: F401  (the fixture)

SIZE = 1000


def sha(n: int) -> str:
    return f"{n:064x}"


def workers(s, n: int = 3) -> None:
    for i in range(n):
        s.add(StorageWorker(id=f"w{i}", url=f"http://127.0.0.1:{7000 + i}", source="static", state="up",
                            free_bytes=10**12, capacity_bytes=10**12, last_seen=now()))
    s.flush()


def checkpoint(s, name: str, contents: list[int], *, state: str = "verified", copies: tuple[str, ...] = ("w0", "w1"),
               run: str = "/r", step: int | None = None) -> int:
    """A checkpoint whose shards reference ``contents``, its store job in ``state``, each
    content with verified copies on ``copies`` (added where missing)."""
    reference(s, {sha(n): SIZE for n in contents})
    ck = Checkpoint(path=f"{run}/{name}", run=run, name=name, is_dir=False, version=name, step=step,
                    mtime=now().timestamp(), total_bytes=SIZE * len(contents), local_present=True, current=True)
    s.add(ck)
    s.flush()
    f = CheckpointFile(checkpoint_id=ck.id, relpath="", size=SIZE * len(contents), sha256="f" * 64, format="opaque",
                       mtime_ns=0)
    s.add(f)
    s.flush()
    for seq, n in enumerate(contents):
        s.add(Shard(file_id=f.id, seq=seq, kind="raw", sha256=sha(n), size=SIZE, src_offset=seq * SIZE, length=SIZE))
        content = s.get(Content, sha(n))
        held = {c.worker_id for c in content.copies}
        t = now() - timedelta(minutes=5)
        for w in copies:
            if w not in held:
                content.copies.append(ContentCopy(worker_id=w, state="verified", stored_at=t, verified_at=t,
                                                  checked_at=t, attempts=0))
    job = create_job(s, "store", checkpoint_id=ck.id)
    s.flush()
    job.state = state  # test setup only: the store reached this state
    s.flush()
    return ck.id


def forget(s, checkpoint_id: int, *, local_copy: bool = False) -> None:
    """Forget a checkpoint; without ``local_copy`` its local copy is gone too (rotated): a
    forgotten checkpoint still on the training disk keeps its content (test below)."""
    job = s.scalar(select(Job).where(Job.checkpoint_id == checkpoint_id, Job.kind == "store"))
    assert transition(s, job.id, "store", job.state, "forgotten", detail="test")
    s.get(Checkpoint, checkpoint_id).local_present = local_copy


def test_a_forgotten_checkpoint_keeps_its_content_while_its_local_copy_is_on_disk(db):
    """Its local copy is rotated by the local policy only while RF good copies exist
    (invariant 1): collecting them first would leave that copy undeletable, the disk full."""
    db = no_grace(db)
    with session_scope(db.db_url) as s:
        workers(s)
        a = checkpoint(s, "a", [1])
        checkpoint(s, "b", [2])
        forget(s, a, local_copy=True)
    assert gc.mark(db) == (0, 0)
    with session_scope(db.db_url) as s:
        s.get(Checkpoint, a).local_present = False  # rotated by the local policy
    assert gc.mark(db) == (1, SIZE)


def content_states(s) -> dict[int, str]:
    return {int(c.sha256, 16): c.state for c in s.scalars(select(Content))}


def no_grace(db):
    return dataclasses.replace(db, gc_grace_seconds=0)


def test_only_content_no_kept_checkpoint_references_is_condemned(db):
    db = no_grace(db)
    with session_scope(db.db_url) as s:
        workers(s)
        a = checkpoint(s, "a", [1, 2])
        checkpoint(s, "b", [2, 3])
        checkpoint(s, "c", [4], state="sharded")  # a store still running keeps what it references
        forget(s, a)
    assert gc.mark(db) == (1, SIZE)
    with session_scope(db.db_url) as s:
        assert content_states(s) == {1: "condemned", 2: "live", 3: "live", 4: "live"}
        # A condemned content's copies never count: nothing is protected by a copy about to go.
        condemned = content_copies(s, [sha(1)])[sha(1)]
        assert len(condemned) == 2 and not any(is_good(c) for c in condemned)
        jobs = gc.request_gc(s, db)
        assert sorted(j.params["worker_id"] for j in jobs) == ["w0", "w1"]


def test_the_grace_period_delays_the_mark(db):
    with session_scope(db.db_url) as s:
        workers(s)
        forget(s, checkpoint(s, "a", [1]))
    assert gc.mark(dataclasses.replace(db, gc_grace_seconds=3600)) == (0, 0)
    assert gc.mark(no_grace(db)) == (1, SIZE)


def test_a_superseded_version_releases_its_content_and_the_new_version_keeps_what_it_shares(db):
    from pipeline.db.transitions import transition as move

    db = no_grace(db)
    with session_scope(db.db_url) as s:
        workers(s)
        old = checkpoint(s, "a", [1, 2])
        checkpoint(s, "a2", [2, 3])
        job = s.scalar(select(Job).where(Job.checkpoint_id == old))
        move(s, job.id, "store", "verified", "superseded", detail="new content at the path")
        assert s.get(Checkpoint, old).released_at is not None
    gc.mark(db)
    with session_scope(db.db_url) as s:
        assert content_states(s) == {1: "condemned", 2: "live", 3: "live"}


def test_a_store_that_references_condemned_content_revives_it_and_uploads_it_again(detected):  # noqa: F811
    db, path, job_id = detected
    with session_scope(db.db_url) as s:
        # A collection condemned these contents just before the store referenced them.
        shas = list(s.scalars(select(Shard.sha256)))
        s.execute(update(Content).where(Content.sha256.in_(shas)).values(state="condemned", condemned_at=now()))
    sends = sharding.shard_checkpoint(db, job_id)
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == "sharded"
        assert set(content_states(s).values()) == {"live"}
        copies = [i for send in sends for i in (send.args[0], *(send.args[1] if len(send.args) > 1 else ()))]
        assert len(set(copies)) == len(copies) == db.rf * len(set(shas))  # every copy sent, once


def test_a_revived_content_keeps_the_copies_the_sweep_had_not_marked_and_replaces_the_others(db):
    """The sweep marks a worker's copies ``deleting`` under the content's lock, and only while
    the content is condemned; the shard step revives it under the same lock."""
    with session_scope(db.db_url) as s:
        workers(s)
        forget(s, checkpoint(s, "old", [1]))  # copies on w0 and w1
    gc.mark(no_grace(db))
    with session_scope(db.db_url) as s:  # the sweep of w0 marked its copy (the file is being deleted)
        s.execute(update(ContentCopy).where(ContentCopy.worker_id == "w0").values(state="deleting"))
    with session_scope(db.db_url) as s:  # a new checkpoint references content 1: the shard step revives it
        checkpoint(s, "new", [1], state="detected", copies=())
        (content,) = sharding.revive(s, [s.get(Content, sha(1))])
        placed = place(s, content, 2)
        assert content.state == "live" and [c.worker_id for c in placed] == ["w2"]  # not w0: its file goes
    with session_scope(db.db_url) as s:  # the sweep of w1 comes next: nothing of content 1 is its business
        assert gc.request_gc(s, db) == []
        left = dict(s.execute(select(ContentCopy.worker_id, ContentCopy.state)).all())
    assert left == {"w0": "deleting", "w1": "verified", "w2": "pending"}


def test_a_store_that_cannot_be_placed_waits_saying_how_much_room_it_needs(detected):  # noqa: F811
    db, path, job_id = detected
    db = dataclasses.replace(db, rf=3)  # two workers
    assert sharding.shard_checkpoint(db, job_id) == []
    with session_scope(db.db_url) as s:
        job = s.get(Job, job_id)
        assert job.state == "waiting"
        assert "cluster full: needs" in job.blocked_reason and "on 3 distinct workers, and only 2" in job.blocked_reason
        assert not s.scalars(select(ContentCopy)).all()  # all placed or none


def test_a_corrupt_copy_found_through_one_checkpoint_counts_for_every_checkpoint_sharing_it(db):
    with session_scope(db.db_url) as s:
        workers(s)
        a = checkpoint(s, "a", [1, 2])
        b = checkpoint(s, "b", [2, 3])
        since = fresh_after(db.freshness_seconds)
        assert deletion_blocker(shard_copies(s, a), need=Need(2), fresh_after=since) is None
        # B's verify (or a scrub) finds content 2 corrupt on w0: one row, so A sees it too.
        s.execute(update(ContentCopy).where(ContentCopy.sha256 == sha(2), ContentCopy.worker_id == "w0")
                  .values(state="corrupt"))
        blocked = deletion_blocker(shard_copies(s, a), need=Need(2), fresh_after=since)
        assert blocked is not None and "1/2" in blocked
        assert deletion_blocker(shard_copies(s, b), need=Need(2), fresh_after=since) is not None


def test_a_lost_repair_does_not_block_rotation_once_the_content_recovered(db):
    with session_scope(db.db_url) as s:
        workers(s)
        a = checkpoint(s, "a", [1])
        s.execute(update(ContentCopy).values(state="missing"))
        repair = request_repair(s, db, sha(1), "test")
        transition(s, repair.id, "repair", "queued", "repairing")
        transition(s, repair.id, "repair", "repairing", "lost", detail="no copy matches")
        store = s.scalar(select(Job.id).where(Job.checkpoint_id == a, Job.kind == "store"))
        assert unsafe_reason(s, db, a, store) is not None
        t = now()  # the worker comes back with its copies; reconcile re-hashes them
        s.execute(update(ContentCopy).values(state="verified", stored_at=t - timedelta(seconds=1), verified_at=t))
        assert unsafe_reason(s, db, a, store) is None


def _race(db, fn, n: int = 2) -> list:
    """Run ``fn(i)`` in ``n`` threads, each in its own transaction, released together."""
    barrier, results, errors = threading.Barrier(n), [None] * n, []

    def run(i: int) -> None:
        try:
            barrier.wait()
            with session_scope(db.db_url) as s:
                results[i] = fn(s, i)
        except Exception as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


def test_two_reconciles_never_both_trim_one_surplus(db):
    with session_scope(db.db_url) as s:
        workers(s)
        checkpoint(s, "a", [1], copies=("w0", "w1", "w2"))  # one copy more than RF 2
    for _ in range(5):
        trimmed = _race(db, lambda s, i: _trim_if_surplus(s, f"w{i}", sha(1), 2))
        with session_scope(db.db_url) as s:
            good = s.scalars(select(ContentCopy.worker_id).where(ContentCopy.state == "verified")).all()
            assert sum(trimmed) == 1 and len(good) == 2
            s.execute(update(ContentCopy).values(state="verified"))  # again, from the start


def test_two_repairs_of_one_content_never_both_run(db):
    with session_scope(db.db_url) as s:
        workers(s)
        checkpoint(s, "a", [1])
    for _ in range(5):
        jobs = _race(db, lambda s, i: request_repair(s, db, sha(1), f"asked by {i}"))
        assert sum(1 for j in jobs if j is not None) == 1
        with session_scope(db.db_url) as s:
            s.execute(update(Job).where(Job.kind == "repair").values(state="done"))


def test_the_mark_never_condemns_what_a_store_references_between_its_query_and_its_lock(db, monkeypatch):
    """The dangerous interleaving, made to happen: the mark finds content 1 unreferenced;
    before it locks the content, a store references content 1 and checks it is live (as the
    shard step does), and would go on. The mark must see that reference under its lock and
    keep the content. (On SQLite the store cannot start before the mark commits: it then finds
    the content condemned and waits, which is just as safe.)"""
    db = no_grace(db)
    with session_scope(db.db_url) as s:
        workers(s)
        forget(s, checkpoint(s, "old", [1]))  # content 1: garbage, until the store below
    found, stored = threading.Event(), threading.Event()
    original = gc.garbage

    def garbage_then_pause(*args, **kwargs):
        out = original(*args, **kwargs)
        found.set()
        stored.wait(2)  # PostgreSQL: the store runs now; SQLite: it waits for this transaction
        return out

    monkeypatch.setattr(gc, "garbage", garbage_then_pause)
    outcome: dict[str, object] = {}

    def store() -> None:
        found.wait(10)
        with session_scope(db.db_url) as s:
            cid = checkpoint(s, "new", [1, 2], state="detected", copies=())
        with session_scope(db.db_url) as s:  # the shard step's check: go on only if every content is live
            live = s.scalar(select(Content.state).where(Content.sha256 == sha(1))) == "live"
            if live:
                s.execute(update(Job).where(Job.checkpoint_id == cid).values(state="sharded"))
        outcome["went on"] = live
        stored.set()

    t = threading.Thread(target=store)
    t.start()
    marked = gc.mark(db)
    t.join(30)
    with session_scope(db.db_url) as s:
        state = s.scalar(select(Content.state).where(Content.sha256 == sha(1)))
    if outcome["went on"]:
        assert state == "live" and marked == (0, 0)
    else:
        assert state != "live" and db.db_url.startswith("sqlite")


def test_forget_refuses_pinned_unprotected_and_the_newest_and_the_policy_keeps_pins(db):
    from pipeline.errors import CkptError

    with session_scope(db.db_url) as s:
        workers(s)
        ids = [checkpoint(s, f"step_{i}", [i], step=i) for i in range(1, 6)]
        running = checkpoint(s, "step_9", [9], step=9, state="sharded")
        s.get(Checkpoint, ids[0]).pinned = True
    with session_scope(db.db_url) as s:
        for ref, why in ((ids[0], "pinned"), (ids[-1], "newest protected"), (running, "only protected")):
            with pytest.raises(CkptError, match=why):
                retention.forget(s, [str(ref)])
        assert [v.checkpoint_id for v in retention.forget(s, [str(ids[1])], dry_run=True)] == [ids[1]]
    with session_scope(db.db_url) as s:
        assert s.scalar(select(Job.state).where(Job.checkpoint_id == ids[1])) == "verified"  # a dry run
    policy = dataclasses.replace(db, remote_keep_last=2)
    with session_scope(db.db_url) as s:
        gone = retention.apply_policy(s, policy)
    assert sorted(v.checkpoint_id for v in gone) == [ids[1], ids[2]]  # the pin and the last two stay
    with session_scope(db.db_url) as s:
        states = dict(s.execute(select(Job.checkpoint_id, Job.state).where(Job.kind == "store")).all())
        assert [states[i] for i in ids] == ["verified", "forgotten", "forgotten", "verified", "verified"]
        assert states[running] == "sharded"


def test_the_history_of_long_forgotten_checkpoints_is_compacted(db):
    from pipeline.db.models import JobEvent

    with session_scope(db.db_url) as s:
        workers(s)
        old, recent = checkpoint(s, "old", [1]), checkpoint(s, "recent", [2])
        checkpoint(s, "kept", [3])
        forget(s, old)
        forget(s, recent)
        s.execute(update(Checkpoint).where(Checkpoint.id == old).values(released_at=now() - timedelta(days=31)))
    with session_scope(db.db_url) as s:
        assert retention.compact_history(s, db) >= 1
    with session_scope(db.db_url) as s:
        events = dict(s.execute(select(Job.checkpoint_id, func.count(JobEvent.id)).join(JobEvent)
                                .group_by(Job.checkpoint_id)).all())
        states = dict(s.execute(select(Job.checkpoint_id, Job.state)).all())
    assert old not in events and events[recent] >= 1 and states[old] == "forgotten"
