"""Garbage collection broken: the collector killed at every commit, a store deduplicating onto
content being collected, a worker down during a collection, two collectors at once, and a
disk filled to its high watermark during a store. Every row: no kept content lost (the
harness checks the disks), and the garbage is gone once the cluster is quiet.

The cluster keeps the newest 2 protected checkpoints of the run remotely (and 1 locally), with
no grace period and no scheduled collection: each new step makes its predecessors' unshared
content garbage, and the test decides when a collection runs.
"""
from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from pipeline.db.engine import session_scope
from pipeline.db.models import Content, ContentCopy
from pipeline.integrity import gc
from tests.faults.harness import FaultCluster, Table, check_rows, sha256_of, trial
from tests.faults.test_stage_kills import points
from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

GC_ENV = {"CKPT_REMOTE_KEEP_LAST": "2", "CKPT_GC_GRACE_SECONDS": "0", "CKPT_GC_CRON": "", "CKPT_GC_BATCH": "2"}


@pytest.fixture(scope="module")
def gc_cluster(tmp_path_factory):
    # Each worker may use 3 MB of its disk: a dozen stores without a collection fill them past
    # the 90 % watermark. (Placement weighs workers by free space: they fill evenly.)
    c = FaultCluster(tmp_path_factory.mktemp("gc-faults"), env=GC_ENV, workers=4,
                     worker_args=dict.fromkeys(range(4), ("--capacity", "3M")))
    try:
        yield c.start()
    finally:
        c.stop()


def collect(c: FaultCluster) -> list[int]:
    """`ckpt gc`: mark, then one collection job per worker holding garbage."""
    gc.mark(c.settings)
    with session_scope(c.settings.db_url) as s:
        ids = [j.id for j in gc.request_gc(s, c.settings, reason="fault test")]
    for job_id in ids:
        c.send("gc", job_id)
    return ids


def garbage_left(c: FaultCluster) -> list[str]:
    """Files on the workers' disks of content no kept checkpoint references, and rows of
    condemned content: what a finished collection leaves (nothing)."""
    with session_scope(c.settings.db_url) as s:
        live = set(s.scalars(select(Content.sha256).where(Content.state == "live")))
        condemned = s.scalar(select(func.count(Content.sha256)).where(Content.state == "condemned"))
        held = set(s.scalars(select(ContentCopy.sha256)))
    files = [p for w in c.workers for p in (w.data / "shards").rglob("*") if p.is_file()]
    left = [f"{p}: not live" for p in files if p.name not in live]
    left += [f"{p}: no copy row" for p in files if p.name not in held]
    return left + ([f"{condemned} contents still condemned"] if condemned else [])


def _has_garbage(c: FaultCluster) -> bool:
    with session_scope(c.settings.db_url) as s:
        return bool(gc.garbage(s, c.settings, limit=1))


def test_collector_killed_at_every_commit(gc_cluster: FaultCluster, trials: int):
    c = gc_cluster
    for _ in range(3):
        c.new_checkpoint()
        c.quiet()
    wait_for(lambda: _has_garbage(c), 30, "the policy to forget a step")
    with c.trace() as t:
        ids = collect(c)
        assert ids
        wait_for(lambda: all(c.job(i).state == "done" for i in ids), 60, "a traced collection")
    assert not garbage_left(c), garbage_left(c)
    names = points(t.names, {"gc"})
    assert {"gc.commit1.after", "gc.commit2.after", "gc.commit3.after"} <= set(names), t.names
    if trials == 1:
        names = t.places(names)
    rows = []
    for name in names:
        row = Table.row(f"SIGKILL collector at {name}")
        for _ in range(trials):
            c.new_checkpoint()
            c.quiet()
            wait_for(lambda: _has_garbage(c), 30, "the policy to forget a step")
            c.arm(name, "kill")
            trial(c, row, lambda: collect(c), name)
            # The killed collection is re-driven by its lease and finishes.
            wait_for(lambda: not garbage_left(c), 60, f"the collection killed at {name} to finish")
        rows.append(row)
    check_rows(*rows)


def test_store_deduplicating_onto_content_being_collected(gc_cluster: FaultCluster, trials: int):
    """Step N is forgotten and its content condemned; while the collection deletes it (slowed
    down), the trainer saves the very same weights again under a new name. The new store must
    end verified with RF good copies on the disks, whatever the collection had deleted."""
    c = gc_cluster
    row = Table.row("store dedups onto content being collected")
    for _ in range(trials):
        for _ in range(3):
            c.new_checkpoint()
            c.quiet()
        wait_for(lambda: _has_garbage(c), 30, "the policy to forget a step")
        old_step = c.step - 2  # forgotten: the new save repeats its content
        c.arm("gc.commit2.after", "sleep 2")  # copies marked deleting; the deletion waits

        def fire() -> None:
            collect(c)
            wait_for(lambda: c.fired("gc.commit2.after"), 30, "the collection to start deleting")
            c.step += 1
            path = c.run / f"step_{c.step}.safetensors"
            c.expecting.append(path)
            from tests.checkpoints import atomic_save, state_dict

            atomic_save(state_dict(old_step, layers=2, width=64), path)  # the same bytes as step old_step

        trial(c, row, fire, None)
        wait_for(lambda: not garbage_left(c), 60, "the collection to finish")
        newest = c.run / f"step_{c.step}.safetensors"
        job = c.detected(newest)
        assert c.job(job).state in ("verified", "rotated"), c.job(job).state
        dest = c.tmp / f"restored-{c.step}.safetensors"
        assert c.restore(newest, dest).state == "done"
        assert sha256_of(dest) == sha256_of(newest)
        dest.unlink()
    check_rows(row)


def test_worker_down_during_collection_deletes_its_garbage_when_back(gc_cluster: FaultCluster, trials: int):
    c = gc_cluster
    row = Table.row("worker down during a collection, then back")
    for _ in range(trials):
        for _ in range(2):
            c.new_checkpoint()
            c.quiet()
        wait_for(lambda: _has_garbage(c), 30, "the policy to forget a step")
        down = c.workers[0]

        def fire() -> None:
            down.kill()
            wait_for(lambda: _worker_state(c, down.node_id) == "down", 30, "the worker seen down")
            ids = collect(c)
            wait_for(lambda: all(c.job(i).state == "done" for i in ids), 60, "the collection")
            assert any(down.data.joinpath("shards").rglob("*")), "nothing left on the down worker to collect"

        trial(c, row, fire, None)  # the harness restarts the dead worker; its reconcile deletes the rest
        wait_for(lambda: not garbage_left(c), 60, "the returning worker's garbage deleted")
    check_rows(row)


def _worker_state(c: FaultCluster, node: str) -> str | None:
    from pipeline.db.models import StorageWorker

    with session_scope(c.settings.db_url) as s:
        return s.scalar(select(StorageWorker.state).where(StorageWorker.id == node))


def test_two_collectors_at_once(gc_cluster: FaultCluster, trials: int):
    c = gc_cluster
    row = Table.row("two collectors at once")
    for _ in range(trials):
        for _ in range(2):
            c.new_checkpoint()
            c.quiet()
        wait_for(lambda: _has_garbage(c), 30, "the policy to forget a step")

        def fire() -> None:
            ids: list[int] = []
            threads = [threading.Thread(target=lambda: ids.extend(collect(c))) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            wait_for(lambda: all(c.job(i).state == "done" for i in ids), 60, "both collections")

        trial(c, row, fire, None)
        assert not garbage_left(c), garbage_left(c)
    check_rows(row)


def test_disk_filled_to_the_watermark_during_stores(gc_cluster: FaultCluster, trials: int):
    """Stores without a collection fill the workers past 90 % of their 3 MB: each becomes
    ``full`` (placement skips it; its copies still count), and once none can take a copy the
    next store waits, saying so. Nothing is lost; a collection frees room, the workers are up
    again and the waiting stores go on."""
    c = gc_cluster
    row = Table.row("workers filled to the watermark during stores")
    for _ in range(trials):
        def fire() -> None:
            for _ in range(40):
                path = c.new_checkpoint()
                wait_for(lambda: (j := c.detected(path)) and c.job(j).state in ("verified", "rotated", "waiting"),
                         60, f"{path.name} protected or waiting")
                if c.job(c.detected(path)).state == "waiting":
                    break
            else:
                raise AssertionError("40 stores and the cluster never filled up")
            states = {_worker_state(c, w.node_id) for w in c.workers}
            assert "full" in states, states
            waiting = c.job(c.detected(path))
            assert "cluster full" in waiting.blocked_reason, waiting.blocked_reason
            assert not c.check().problems  # nothing lost while full
            collect(c)
            wait_for(lambda: not garbage_left(c), 60, "the collection")
            wait_for(lambda: {_worker_state(c, w.node_id) for w in c.workers} == {"up"}, 30,
                     "every worker back under the watermark")
            wait_for(lambda: c.job(c.detected(path)).state in ("verified", "rotated"), 60,
                     "the waiting store to go on")

        trial(c, row, fire, None, timeout=300)
    check_rows(row)
