"""A repair with no source where it runs hands itself to the host that holds the file
(pipeline/integrity/repair.py; docs/design.md, "Hosts").

Given a content whose only local file is on training host node-b, two copies the database
counts as good (so the repair goes to the shared queue), one in fact gone from its storage
worker and one on a worker that does not answer, and one copy known missing, When the repair
runs on node-a (which has no file of it), Then it does not declare the content lost: it hands
the job to node-b, whose run rebuilds the copies from its file. Lost only when no worker and no
host that has not tried holds it. A target that refuses the copy (its disk full) is the
target's failure: the repair tries again later and never calls a content with a good copy lost.
"""
from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
from sqlalchemy import select, update

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, ContentCopy, Job, JobEvent, Shard, StorageWorker
from pipeline.db.transitions import now, transition
from pipeline.detection import catalog, completeness, roots
from pipeline.errors import WorkerError
from pipeline.integrity.repair import repair, request_repair
from pipeline.queues import SHARED, host_queue, queues_for
from pipeline.steps import Send
from pipeline.store.source import local_source, shard_prefix
from tests.checkpoints import atomic_save, state_dict
from tests.processes import KEY, storage_workers, worker_client

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("file_on_b", [True, False], ids=["node-b-holds-the-file", "node-b-lost-it-too"])
def test_a_repair_without_a_source_here_goes_to_the_host_with_the_file(db, tmp_path, file_on_b):
    settings = dataclasses.replace(db, cluster_key=KEY, rf=3)
    (tmp_path / "runs" / "r").mkdir()
    path = atomic_save(state_dict(4), tmp_path / "runs" / "r" / "step_4.safetensors")
    run, ckpt_path = roots.locate(path, settings.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=settings.shard_size)
    (tmp_path / "w").mkdir()
    with storage_workers(tmp_path / "w", 2) as (w1, w2):
        with session_scope(settings.db_url) as s:
            ckpt, job, _ = catalog.record(s, detected, lease_seconds=60, detail="test", host="node-b")
            for a, b in pairwise(["detected", "sharded", "replicated", "verified"]):
                transition(s, job.id, "store", a, b)
            for wid, url in ((w1.node_id, w1.url), (w2.node_id, w2.url), ("w-silent", "http://127.0.0.1:9")):
                s.add(StorageWorker(id=wid, url=url, source="static", state="up", free_bytes=10**10,
                                    capacity_bytes=2 * 10**10, last_seen=now()))
            s.flush()
            sha = s.scalars(select(Shard.sha256).join(Shard.file).where(Shard.kind == "safetensors")
                            .order_by(Shard.seq)).first()
            t = now()
            s.add(ContentCopy(worker_id=w1.node_id, sha256=sha, state="verified", stored_at=t, verified_at=t,
                              checked_at=t, attempts=0))  # counted good, but w1 never got the bytes
            s.add(ContentCopy(worker_id="w-silent", sha256=sha, state="verified", stored_at=t, verified_at=t,
                              checked_at=t, attempts=0))  # counted good, its worker does not answer
            s.add(ContentCopy(worker_id=w2.node_id, sha256=sha, state="missing", checked_at=t, attempts=0))
            s.flush()
            job_id = request_repair(s, settings, sha, "test").id
            assert queues_for(s, Send("repair", (job_id,))) == [SHARED]  # a good copy, as far as it knows

        on_a = dataclasses.replace(settings, host="node-a")
        assert repair(on_a, job_id) == [Send("repair", (job_id,))]
        with session_scope(settings.db_url) as s:
            job = s.get(Job, job_id)
            assert job.state == "repairing" and job.params["host"] == "node-b", (job.state, job.last_error)
            assert queues_for(s, Send("repair", (job_id,))) == [host_queue("node-b")]
            notes = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == job_id)).all()
            assert any("handed to host node-b" in (n or "") for n in notes), notes
            attempts = job.attempts
        assert repair(on_a, job_id) == [Send("repair", (job_id,))]  # a stale delivery on node-a forwards it
        with session_scope(settings.db_url) as s:
            assert s.get(Job, job_id).attempts == attempts

        if not file_on_b:
            path.unlink()
        on_b = dataclasses.replace(settings, host="node-b")
        if not file_on_b:
            # w-silent's copy is counted and its worker did not answer: it may be fine, so the
            # repair is retried, not LOST, until that worker is known down.
            with pytest.raises(WorkerError, match="did not answer"):
                repair(on_b, job_id)
            with session_scope(settings.db_url) as s:
                assert s.get(Job, job_id).state == "repairing"
                s.execute(update(StorageWorker).where(StorageWorker.id == "w-silent").values(state="down"))
        repair(on_b, job_id)
        with session_scope(settings.db_url) as s:
            job = s.get(Job, job_id)
            if file_on_b:
                assert job.state == "done", job.last_error
            else:  # nobody left to try: now it is lost, and says so
                assert job.state == "lost" and "LOST" in job.last_error
            assert s.get(Checkpoint, ckpt.id).host == "node-b"
        held = [worker_client(w).verify([sha])[0]["sha256"] for w in (w1, w2)]
        assert held == ([sha, sha] if file_on_b else [None, None])


def _one_good_copy(settings, tmp_path, good, others):
    """A checkpoint recorded and verified whose one content copy counted is on ``good`` (its
    bytes really there); ``others`` are registered as up; a repair job for that content. The
    local file is then removed (rotated): the copy on ``good`` is the only one."""
    (tmp_path / "runs" / "r").mkdir()
    path = atomic_save(state_dict(4), tmp_path / "runs" / "r" / "step_4.safetensors")
    run, ckpt_path = roots.locate(path, settings.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=settings.shard_size)
    with session_scope(settings.db_url) as s:
        ckpt, job, _ = catalog.record(s, detected, lease_seconds=60, detail="test", host=settings.host_id)
        for a, b in pairwise(["detected", "sharded", "replicated", "verified"]):
            transition(s, job.id, "store", a, b)
        for w in (good, *others):
            s.add(StorageWorker(id=w.node_id, url=w.url, source="static", state="up", free_bytes=10**10,
                                capacity_bytes=2 * 10**10, last_seen=now()))
        s.flush()
        sha = s.scalars(select(Shard.sha256).join(Shard.file).where(Shard.kind == "safetensors")
                        .order_by(Shard.seq)).first()
        src = local_source(s, sha, settings.host_id)
        worker_client(good).put_range(sha, shard_prefix(src.path, src.kind, src.tensors), src.path, src.offset,
                                      src.length)
        t = now()
        s.add(ContentCopy(worker_id=good.node_id, sha256=sha, state="verified", stored_at=t, verified_at=t,
                          checked_at=t, attempts=0))
        s.flush()
        job_id = request_repair(s, settings, sha, "test").id
    path.unlink()
    return sha, job_id


def test_a_target_that_refuses_the_copy_is_not_a_lost_content(db, tmp_path):
    """Found by the chaos soak: a repair whose target's disk was full blamed the good source,
    dropped it and declared the content LOST while that copy was verified."""
    settings = dataclasses.replace(db, cluster_key=KEY, rf=2)
    (tmp_path / "w").mkdir()
    (tmp_path / "full").mkdir()
    with storage_workers(tmp_path / "w", 1) as (good,), \
            storage_workers(tmp_path / "full", 1, args=("--capacity", "100")) as (full,):
        sha, job_id = _one_good_copy(settings, tmp_path, good, [full])

        with pytest.raises(WorkerError) as refused:
            repair(settings, job_id)
        assert refused.value.worker == full.url and refused.value.status == 507
        with session_scope(settings.db_url) as s:
            job = s.get(Job, job_id)
            assert job.state == "repairing", (job.state, job.last_error)
            assert s.scalar(select(ContentCopy.state).where(ContentCopy.sha256 == sha,
                                                            ContentCopy.worker_id == good.node_id)) == "verified"
        assert worker_client(good).verify([sha])[0]["sha256"] == sha


def test_a_source_that_does_not_answer_is_not_a_lost_content(db, tmp_path):
    """Found by the 30-minute chaos soak: a repair ran while the worker holding the only good
    copy was being restarted (SIGKILLed); it dropped that source as if bad and declared the
    content LOST. A source that does not answer is retried later; once it is back, the repair
    rebuilds the copy."""
    settings = dataclasses.replace(db, cluster_key=KEY, rf=2)
    (tmp_path / "w").mkdir()
    (tmp_path / "w2").mkdir()
    with storage_workers(tmp_path / "w", 1) as (good,), storage_workers(tmp_path / "w2", 1) as (other,):
        sha, job_id = _one_good_copy(settings, tmp_path, good, [other])
        good.stop()
        with pytest.raises(WorkerError) as unreachable:
            repair(settings, job_id)
        assert unreachable.value.worker == good.url and "retried" in unreachable.value.reason
        with session_scope(settings.db_url) as s:
            job = s.get(Job, job_id)
            assert job.state == "repairing", (job.state, job.last_error)

        good.start()
        repair(settings, job_id)
        with session_scope(settings.db_url) as s:
            assert s.get(Job, job_id).state == "done", s.get(Job, job_id).last_error
        assert [worker_client(w).verify([sha])[0]["sha256"] for w in (good, other)] == [sha, sha]
