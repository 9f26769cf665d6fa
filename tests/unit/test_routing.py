"""Hosts: a path names a checkpoint on one host, and every step that touches local files is
sent to the queue of the host that holds them (pipeline/queues.py)."""
from __future__ import annotations

from itertools import pairwise

from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, ContentCopy, StorageWorker
from pipeline.db.transitions import create_job, now, transition
from pipeline.detection import catalog, completeness, roots
from pipeline.queues import SHARED, host_queue, queues_for
from pipeline.steps import Send
from tests.checkpoints import atomic_save, state_dict


def _record(s, path, host, *, protect=False):
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as ses:
        ckpt, job, created = catalog.record(ses, detected, lease_seconds=60, detail="test", host=host)
        if protect:
            for a, b in pairwise(["detected", "sharded", "replicated", "verified"]):
                transition(ses, job.id, "store", a, b)
        return ckpt.id, job.id, created


def test_the_same_path_on_two_hosts_is_two_checkpoints(db, tmp_path):
    """Two nodes running the same script write the same path to their own disks: neither
    supersedes the other, and a path means this host's checkpoint."""
    (tmp_path / "runs" / "r").mkdir()
    path = atomic_save(state_dict(1), tmp_path / "runs" / "r" / "step_1.safetensors")
    a, _, _ = _record(db, path, "node-a")
    atomic_save(state_dict(2), path)  # node b's bytes at the same path
    b, _, created = _record(db, path, "node-b")
    assert created and a != b
    with session_scope(db.db_url) as ses:
        assert [c.current for c in ses.scalars(select(Checkpoint).order_by(Checkpoint.id))] == [True, True]
        assert catalog.resolve(ses, str(path), "node-a").id == a
        assert catalog.resolve(ses, str(path), "node-b").id == b
    atomic_save(state_dict(3), path)  # a new save on node a supersedes only node a's
    a2, _, _ = _record(db, path, "node-a")
    with session_scope(db.db_url) as ses:
        current = {c.id for c in ses.scalars(select(Checkpoint).where(Checkpoint.current.is_(True)))}
    assert current == {a2, b}


def test_local_steps_go_to_the_owning_hosts_queue_and_the_rest_anywhere(db, tmp_path):
    (tmp_path / "runs" / "r").mkdir()
    pa = atomic_save(state_dict(1), tmp_path / "runs" / "r" / "a.safetensors")
    pb = atomic_save(state_dict(2), tmp_path / "runs" / "r" / "b.safetensors")
    a_ckpt, a_job, _ = _record(db, pa, "node-a")
    _b_ckpt, b_job, _ = _record(db, pb, "node-b", protect=True)
    with session_scope(db.db_url) as ses:
        ses.add(StorageWorker(id="w1", url="http://127.0.0.1:1", source="static", state="up", last_seen=now()))
        ses.flush()
        shas = {cid: {sh.sha256 for f in ses.get(Checkpoint, cid).files for sh in f.shards}
                for cid in (a_ckpt, _b_ckpt)}
        sha_a = sorted(shas[a_ckpt] - shas[_b_ckpt])[0]  # content only node a's file holds
        copy = ContentCopy(sha256=sha_a, worker_id="w1", state="pending", attempts=0)
        ses.add(copy)
        ses.flush()
        restore = create_job(ses, "restore", checkpoint_id=_b_ckpt, params={"dest": "/x", "host": "node-c"})
        repair = create_job(ses, "repair", checkpoint_id=None, sha256=sha_a, params={"sha256": sha_a})
        scrub = create_job(ses, "scrub", checkpoint_id=None, params={"worker_id": "w1"})
        copy_id, restore_id, repair_id, scrub_id = copy.id, restore.id, repair.id, scrub.id
        run = str(tmp_path / "runs" / "r")
        cases = {
            ("shard", a_job): [host_queue("node-a")],
            ("rotate", b_job): [host_queue("node-b")],
            ("replicate", copy_id): [host_queue("node-a")],  # node a's file holds the bytes
            ("rotate_run", run): sorted([host_queue("node-a"), host_queue("node-b")]),
            ("restore", restore_id): [host_queue("node-c")],  # the host that asked
            ("repair", repair_id): [host_queue("node-a")],  # no good remote copy: from the local file
            ("scrub", scrub_id): [SHARED],
            ("verify", a_job): [SHARED],
        }
        got = {k: queues_for(ses, Send(k[0], (k[1],))) for k in cases}
    assert got == cases


def test_a_checkpoint_from_before_hosts_is_any_hosts(db, tmp_path):
    (tmp_path / "runs" / "r").mkdir()
    path = atomic_save(state_dict(1), tmp_path / "runs" / "r" / "old.safetensors")
    _ckpt, job, _ = _record(db, path, None)
    with session_scope(db.db_url) as ses:
        assert queues_for(ses, Send("shard", (job,))) == [SHARED]
        assert catalog.owner_elsewhere(ses, _ckpt, "node-a") is None


def test_a_checkpoint_waiting_for_a_silent_host_says_so(db, tmp_path):
    """A host that is gone leaves its checkpoints as they are; status says what they wait for."""
    from datetime import timedelta

    from pipeline.db.models import TrainingHost
    from pipeline.detection.watcher import Watcher
    from pipeline.status import checkpoint_rows

    (tmp_path / "runs" / "r").mkdir()
    gone, _, _ = _record(db, atomic_save(state_dict(1), tmp_path / "runs" / "r" / "a.safetensors"), "node-gone")
    here, _, _ = _record(db, atomic_save(state_dict(2), tmp_path / "runs" / "r" / "b.safetensors"), "node-here")
    never, _, _ = _record(db, atomic_save(state_dict(3), tmp_path / "runs" / "r" / "c.safetensors"), "node-never")
    with session_scope(db.db_url) as ses:
        ses.add(TrainingHost(name="node-gone", last_seen=now() - timedelta(minutes=12)))
    import dataclasses

    Watcher(dataclasses.replace(db, host="node-here"), lambda sends: None, use_events=False).report_in()
    with session_scope(db.db_url) as ses:
        rows = {r["id"]: r for r in checkpoint_rows(ses, db, [ses.get(Checkpoint, i) for i in (gone, here, never)])}
    assert rows[gone]["blocked_reason"] == "waiting for host node-gone: not seen for 12 min (its files are there)"
    assert rows[here]["blocked_reason"] is None and rows[here]["host"] == "node-here"
    assert "node-never: it never reported in" in rows[never]["blocked_reason"]


def test_an_object_store_copy_a_worker_can_put_goes_to_any_host_not_behind_the_trainers_uploads(db, tmp_path):
    """A copy on an object store is put by a storage worker once one holds the content
    (pipeline/store/bucket_copy.py): it needs no local file, so it waits in the shared queue,
    not behind the uploads queued on the trainer's host; before, from the trainer's file."""
    (tmp_path / "runs" / "r").mkdir()
    path = atomic_save(state_dict(1), tmp_path / "runs" / "r" / "a.safetensors")
    ckpt, _job, _ = _record(db, path, "node-a")
    with session_scope(db.db_url) as ses:
        ses.add(StorageWorker(id="w1", url="http://127.0.0.1:1", source="static", state="up", last_seen=now()))
        ses.add(StorageWorker(id="target:s3", url="s3://b/p", source="target", tier="objectstore", state="up",
                              last_seen=now()))
        ses.flush()
        sha = sorted({sh.sha256 for f in ses.get(Checkpoint, ckpt).files for sh in f.shards})[0]
        on_store = ContentCopy(sha256=sha, worker_id="target:s3", state="pending", attempts=0)
        on_worker = ContentCopy(sha256=sha, worker_id="w1", state="pending", attempts=0)
        ses.add_all([on_store, on_worker])
        ses.flush()
        assert queues_for(ses, Send("replicate", (on_store.id,))) == [host_queue("node-a")]  # no worker holds it
        on_worker.state, on_worker.stored_at, on_worker.verified_at = "verified", now(), now()
        ses.flush()
        assert queues_for(ses, Send("replicate", (on_store.id,))) == [SHARED]
        assert queues_for(ses, Send("replicate", (on_worker.id,))) == [host_queue("node-a")]
