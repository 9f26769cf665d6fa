"""One checkpoint, several hosts (pipeline/detection/parts.py): a DCP step whose ``.metadata``
is on one host and whose rank files are on another is recorded once both are there, routed to
each file's host, and each host removes its own part once the whole checkpoint is rotated.

The hosts share this machine's disk here, so the other host's files live under its own
directory and its announcement is made at the path both hosts use (tests/multihost holds the
same story with real hosts, mount namespaces and ranks)."""
from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from datetime import timedelta

import pytest
from sqlalchemy import select

from pipeline.cluster.client import WorkerClient
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointPart, ContentCopy, DetectionProblem, StorageWorker
from pipeline.db.transitions import now, transition
from pipeline.detection import catalog, completeness, parts, problems
from pipeline.detection.watcher import Watcher
from pipeline.queues import host_queue, queues_for
from pipeline.steps import Send
from pipeline.store.rotation import plan_run, rotate_part
from tests.checkpoints import dcp_folder
from tests.processes import KEY, storage_workers


def _split_step(db, tmp_path):
    """A DCP step at runs/r/step_1 whose rank file is on node-b: node-a keeps ``.metadata``;
    node-b's copy of the folder (elsewhere on this disk) holds ``__0_0.distcp``."""
    step = dcp_folder(tmp_path / "runs" / "r" / "step_1")
    b_dir = tmp_path / "disk-b" / "step_1"
    b_dir.mkdir(parents=True)
    shutil.move(step / "__0_0.distcp", b_dir / "__0_0.distcp")
    return step, b_dir


def _announce_b(db, step, b_dir):
    """node-b's watcher announcing its part at the path both hosts use."""
    found = completeness.examine(b_dir)
    d = catalog.hash_checkpoint(step.parent, b_dir, found.entries, shard_size=db.shard_size)
    with session_scope(db.db_url) as s:
        return parts.announce(s, dataclasses.replace(d, path=step, run=step.parent), "node-b").id


def _watcher(db, host):
    return Watcher(dataclasses.replace(db, host=host), lambda sends: None, use_events=False)


def rotated(s):
    """The session's one checkpoint, its store job taken to rotated and its local copy gone (as
    node-a's rotation leaves it)."""
    ckpt = s.scalar(select(Checkpoint))
    job = catalog.latest_store_job(s, ckpt.id)
    for a, b in [("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified"),
                 ("verified", "rotated")]:
        transition(s, job.id, "store", a, b)
    ckpt.local_present = False
    return ckpt


def test_a_step_is_recorded_once_every_host_announced_its_part(db, tmp_path):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    step, b_dir = _split_step(db, tmp_path)
    a = _watcher(db, "node-a")
    assert a.consider(step.parent, step) is not None  # waits: .metadata names a file no host has
    with session_scope(db.db_url) as s:
        assert s.scalar(select(Checkpoint)) is None

    assert _watcher(db, "node-b")._part(step.parent, b_dir, completeness.examine(b_dir), db.options_for(
        db.roots[0])) is None  # node-b's own watcher announces its part (at its own path here)
    part_id = _announce_b(db, step, b_dir)
    assert a.consider(step.parent, step) is None
    with session_scope(db.db_url) as s:
        (ckpt,) = s.scalars(select(Checkpoint)).all()
        assert (ckpt.host, ckpt.layout) == ("node-a", "torch-dcp")
        assert {f.relpath: f.host for f in ckpt.files} == {".metadata": None, "__0_0.distcp": "node-b"}
        assert ckpt.total_bytes == sum(f.size for f in ckpt.files)
        assert s.get(CheckpointPart, part_id).checkpoint_id == ckpt.id
        job = catalog.latest_store_job(s, ckpt.id)
        s.add(StorageWorker(id="w1", url="http://127.0.0.1:1", source="static", state="up", last_seen=now()))
        s.flush()
        b_sha = next(f.shards[0].sha256 for f in ckpt.files if f.host == "node-b")
        copy = ContentCopy(sha256=b_sha, worker_id="w1", state="pending", attempts=0)
        s.add(copy)
        s.flush()
        # Each step goes where the files it reads are: node-b's bytes are sent from node-b.
        assert queues_for(s, Send("shard", (job.id,))) == [host_queue("node-a")]
        assert queues_for(s, Send("replicate", (copy.id,))) == [host_queue("node-b")]
        assert queues_for(s, Send("rotate_part", (job.id, "node-b"))) == [host_queue("node-b")]
    # The same step seen again records nothing new.
    a.known.clear()
    assert a.consider(step.parent, step) is None
    with session_scope(db.db_url) as s:
        assert len(s.scalars(select(Checkpoint)).all()) == 1


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Two real storage worker processes: rotate_part asks them, as rotate does."""
    with storage_workers(tmp_path_factory.mktemp("parts"), 2) as ws:
        yield ws


def _rotated(db, tmp_path, workers):
    """The split step recorded, protected (RF verified copies of every content, held by real
    workers), rotated on node-a; node-b's part still there, at the path both hosts use."""
    (tmp_path / "runs" / "r").mkdir(parents=True)
    step, b_dir = _split_step(db, tmp_path)
    _announce_b(db, step, b_dir)
    assert _watcher(db, "node-a").consider(step.parent, step) is None
    with session_scope(db.db_url) as s:
        for f in s.scalar(select(Checkpoint)).files:
            src = (b_dir if f.host == "node-b" else step) / f.relpath
            for sh in f.shards:
                for w in workers:
                    WorkerClient(w.url, KEY.encode(), w.node_id).put_range(sh.sha256, b"", str(src), sh.src_offset,
                                                                           sh.length)
    shutil.rmtree(step)  # node-a's rotation removed its files
    shutil.copytree(b_dir, step, copy_function=shutil.copy2)  # node-b's view of the path
    with session_scope(db.db_url) as s:
        ckpt = rotated(s)
        for w in workers:
            s.add(StorageWorker(id=w.node_id, url=w.url, source="static", state="up", last_seen=now()))
        s.flush()
        for sha in {sh.sha256 for f in ckpt.files for sh in f.shards}:
            for w in (w.node_id for w in workers):
                s.add(ContentCopy(sha256=sha, worker_id=w, state="verified", attempts=1, verified_at=now(),
                                  checked_at=now(), stored_at=now() - timedelta(seconds=5)))
        return step, catalog.latest_store_job(s, ckpt.id).id


def test_each_host_removes_its_own_part_once_the_checkpoint_is_rotated(db, tmp_path, workers):
    step, job_id = _rotated(db, tmp_path, workers)
    b = dataclasses.replace(db, host="node-b", rf=2, cluster_key=KEY)
    # node-b's rotation pass finds its part of a rotated checkpoint
    assert plan_run(b, str(step.parent)) == [Send("rotate_part", (job_id, "node-b"))]
    # on another host, the message goes on to node-b and deletes nothing here
    assert rotate_part(dataclasses.replace(b, host="node-a"), job_id, "node-b") == [
        Send("rotate_part", (job_id, "node-b"))]
    assert (step / "__0_0.distcp").exists()

    (step / "late.txt").write_text("written after it was stored")  # bytes no replica has
    assert rotate_part(b, job_id, "node-b") == []
    assert (step / "__0_0.distcp").exists()
    with session_scope(db.db_url) as s:
        reason = catalog.latest_store_job(s, s.scalar(select(Checkpoint.id))).blocked_reason
    assert reason.startswith("rotation blocked: node-b's part: ") and "late.txt was added" in reason

    (step / "late.txt").unlink()
    assert rotate_part(b, job_id, "node-b") == []
    assert not step.exists()
    with session_scope(db.db_url) as s:
        assert s.scalar(select(CheckpointPart.local_present)) is False
        assert catalog.latest_store_job(s, s.scalar(select(Checkpoint.id))).blocked_reason is None
    assert plan_run(b, str(step.parent)) == []


def test_a_part_is_not_removed_without_rf_copies(db, tmp_path, workers):
    step, job_id = _rotated(db, tmp_path, workers)
    with session_scope(db.db_url) as s:
        for cp in s.scalars(select(ContentCopy).where(ContentCopy.worker_id == workers[1].node_id)):
            cp.state = "corrupt"
    assert rotate_part(dataclasses.replace(db, host="node-b", rf=2, cluster_key=KEY), job_id, "node-b") == []
    assert (step / "__0_0.distcp").exists()


def test_a_part_is_not_removed_when_the_workers_do_not_confirm_their_copies(db, tmp_path, workers):
    """The database says RF good copies; a worker lost one (a disk replaced, a wipe): rotate_part
    asks the workers first, as rotate does, and keeps the part."""
    step, job_id = _rotated(db, tmp_path, workers)
    b_sha = _b_shard(db)
    assert WorkerClient(workers[1].url, KEY.encode(), workers[1].node_id).delete(b_sha)
    b = dataclasses.replace(db, host="node-b", rf=2, cluster_key=KEY)
    assert rotate_part(b, job_id, "node-b") == []
    assert (step / "__0_0.distcp").exists()
    with session_scope(db.db_url) as s:
        reason = catalog.latest_store_job(s, s.scalar(select(Checkpoint.id))).blocked_reason
    assert reason.startswith("rotation blocked: node-b's part: ") and "confirmed by the workers" in reason, reason


def _b_shard(db) -> str:
    with session_scope(db.db_url) as s:
        return next(sh.sha256 for f in s.scalar(select(Checkpoint)).files if f.host == "node-b" for sh in f.shards)


def test_a_watcher_clears_only_its_own_hosts_problems(db, tmp_path):
    with session_scope(db.db_url) as s:
        problems.report(s, "/runs/r/x", "/runs/r", "broken here", "node-a")
        problems.report(s, "/runs/r/x", "/runs/r", "broken there", "node-b")
    _watcher(db, "node-a").reconcile()
    with session_scope(db.db_url) as s:
        assert [(p.host, p.reason) for p in s.scalars(select(DetectionProblem))] == [("node-b", "broken there")]


def test_a_step_saved_again_waits_for_each_hosts_new_part_not_the_stale_one(db, tmp_path):
    """Restarted after a crash, the job saves step 1 again at the same path: node-a's new
    .metadata is there, node-b has not announced its new rank file yet. node-a must neither
    record the new save with node-b's old part (a mix of two saves) nor release the protected
    version; once node-b announces, the new save is recorded with the new part."""
    (tmp_path / "runs" / "r").mkdir(parents=True)
    step, b_dir = _split_step(db, tmp_path)
    _announce_b(db, step, b_dir)
    a = _watcher(db, "node-a")
    assert a.consider(step.parent, step) is None
    with session_scope(db.db_url) as s:
        v1 = s.scalar(select(Checkpoint.id))

    new = dcp_folder(tmp_path / "save-2" / "step_1", seed=9)  # the new save's bytes
    shutil.copyfile(new / ".metadata", step / ".metadata")    # node-a: its .metadata (written last)
    for restarted in (a, _watcher(db, "node-a")):
        restarted.reconcile()
        assert restarted.consider(step.parent, step) is not None  # waits
        with session_scope(db.db_url) as s:
            (only,) = s.scalars(select(Checkpoint)).all()
            assert only.id == v1 and only.current and only.released_at is None
            assert only.disk_changed and ".metadata" in only.disk_changed

    shutil.copyfile(new / "__0_0.distcp", b_dir / "__0_0.distcp")  # node-b's new rank file, announced
    _announce_b(db, step, b_dir)
    assert a.consider(step.parent, step) is None
    with session_scope(db.db_url) as s:
        v2 = s.scalar(select(Checkpoint).where(Checkpoint.current.is_(True)))
        assert v2.id != v1 and v2.disk_changed is None
        b_file = next(f for f in v2.files if f.host == "node-b")
        assert b_file.sha256 == hashlib.sha256((new / "__0_0.distcp").read_bytes()).hexdigest()
        assert catalog.latest_store_job(s, v1).state == "superseded"


def test_a_part_written_again_with_the_same_bytes_belongs_to_the_new_save(db, tmp_path):
    """A re-save that writes node-b's rank file with the same bytes: its new times say it is
    part of the new save (the claim is kept, the part is not stale)."""
    (tmp_path / "runs" / "r").mkdir(parents=True)
    step, b_dir = _split_step(db, tmp_path)
    _announce_b(db, step, b_dir)
    a = _watcher(db, "node-a")
    assert a.consider(step.parent, step) is None
    new = dcp_folder(tmp_path / "save-2" / "step_1", seed=9)
    time.sleep(0.01)
    shutil.copyfile(new / ".metadata", step / ".metadata")
    shutil.copyfile(b_dir / "__0_0.distcp", tmp_path / "b-copy")
    shutil.copyfile(tmp_path / "b-copy", b_dir / "__0_0.distcp")  # same bytes, new time
    _announce_b(db, step, b_dir)
    assert a.consider(step.parent, step) is None
    with session_scope(db.db_url) as s:
        v2 = s.scalar(select(Checkpoint).where(Checkpoint.current.is_(True)))
        assert v2.id != 1 and {f.relpath: f.host for f in v2.files} == {".metadata": None, "__0_0.distcp": "node-b"}
        assert s.scalar(select(CheckpointPart.checkpoint_id)) == v2.id
