"""Attack on issue 28 ("never wedged"): orders of events and peer answers no other test names."""
from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from dramatiq import Message
from sqlalchemy import select

from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint, ContentCopy, Job, StorageWorker
from pipeline.db.transitions import create_job, now, transition
from pipeline.detection import catalog, completeness, roots
from pipeline.steps import Send
from tests.conftest import broker_for

# -- at most one outstanding message per step ----------------------------------------------

@pytest.fixture
def stub(db, process_broker):
    with broker_for(dataclasses.replace(db, redis_url="stub://")) as b:
        yield b


def _all_queued(broker) -> list[Message]:
    return [Message.decode(body) for q in broker.queues.values() for body in list(q.queue)]


def test_one_batch_naming_a_step_twice_queues_one_message(db, stub):
    """send_all reads every row's key before it records any: a batch holding the same keyed
    step twice records two fresh keys (the first overwritten) and enqueues both."""
    from pipeline.tasks.sending import send_all

    with session_scope(db.db_url) as s:
        job_id = create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "w1"}).id
    send_all([Send("scrub", (job_id,)), Send("scrub", (job_id,))])
    assert len(_all_queued(stub)) == 1, [m.message_id for m in _all_queued(stub)]


def _record(s, path, host="node-a"):
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as ses:
        ckpt, job, _created = catalog.record(ses, detected, lease_seconds=60, detail="test", host=host)
        transition(ses, job.id, "store", "detected", "sharded")
        return ckpt.id, job.id


def test_a_re_drive_of_two_stores_sharing_content_queues_one_message_per_copy(db, stub, tmp_path):
    """Two saves with the same bytes (a fine-tune's frozen layers, one model saved in two runs)
    share their contents and so their pending copies. When both stores' leases end in one tick,
    expired_work resumes each with replicate(copy) for every pending copy of its contents: the
    same copy twice in one batch, so two messages per copy per re-drive (N stores: N)."""
    from pipeline.service.scheduler import expired_work
    from pipeline.tasks.sending import send_all
    from tests.checkpoints import atomic_save, state_dict

    s = settings_mod.configure(dataclasses.replace(db, rf=1))
    for run in ("r1", "r2"):
        (tmp_path / "runs" / run).mkdir()
    a = atomic_save(state_dict(7), tmp_path / "runs" / "r1" / "step_1.safetensors")
    b = atomic_save(state_dict(7), tmp_path / "runs" / "r2" / "step_1.safetensors")
    (ca, ja), (cb, jb) = _record(s, a), _record(s, b)
    with session_scope(s.db_url) as ses:
        ses.add(StorageWorker(id="w1", url="http://127.0.0.1:1", source="static", state="up", last_seen=now()))
        ses.flush()
        shas = {sh.sha256 for f in ses.get(Checkpoint, ca).files for sh in f.shards}
        assert shas == {sh.sha256 for f in ses.get(Checkpoint, cb).files for sh in f.shards}
        for sha in sorted(shas):
            ses.add(ContentCopy(sha256=sha, worker_id="w1", state="pending", attempts=0))
        for j in (ja, jb):
            ses.get(Job, j).lease_until = now() - timedelta(seconds=5)
    send_all(expired_work(s))
    per_copy: dict[int, int] = {}
    for m in _all_queued(stub):
        if m.actor_name == "replicate":
            per_copy[m.args[0]] = per_copy.get(m.args[0], 0) + 1
    assert per_copy and max(per_copy.values()) == 1, per_copy


# -- the watcher: one entry's error is that entry's ----------------------------------------

def test_a_database_error_applying_one_hashed_entry_loses_the_others_finished_with_it(settings):
    """Entries hashed by the pool are applied in one batch at the start of a scan. One whose
    recording hit a control-plane error (SQLite 'database is locked' under contention) makes
    Reports.failed re-raise it: the scan ends, and the batch's other entries, taken out of the
    pool already, are never applied. Their checkpoints were recorded, but the watcher does not
    know it: each is hashed again, whole (up to CKPT_MAX_HASH_BYTES per file), at the next scan."""
    from sqlalchemy.exc import OperationalError

    from pipeline.detection.hashpool import HashPool
    from pipeline.detection.watcher import Watcher

    upgrade(settings.db_url)
    w = Watcher(settings, send=lambda sends: None, use_events=False)
    applied: list[str] = []
    pool = HashPool(1)
    w._hashing = pool
    try:
        def locked():
            raise OperationalError("INSERT INTO checkpoints", {}, Exception("database is locked"))

        pool.submit("/runs/a", "/runs/a/step_1", locked)
        pool.submit("/runs/b", "/runs/b/step_9", lambda: (lambda: applied.append("/runs/b/step_9")))
        pool.wait_idle()
        for _ in range(2):  # the scan fails once (the control plane), then works again
            w._scan(None)
        assert applied == ["/runs/b/step_9"], "a recorded entry of another run was dropped: it will be hashed again"
    finally:
        w.close()


def test_a_save_made_while_a_big_checkpoint_is_hashed_at_start_is_detected_meanwhile(settings, tmp_path,
                                                                                       monkeypatch):
    """The watcher's first scan waits for every hash it started (Watcher.run: _scan(wait=True)):
    a watcher (re)started beside a big unrecorded checkpoint looks at no run again, reports its
    host in no more, and is not ready, until that hash ends. A save in another run meanwhile
    waits for it (a trainer's save_total_limit may delete it before it is ever seen)."""
    from pipeline.db.models import Checkpoint
    from pipeline.detection.watcher import Watcher
    from tests.unit.test_watcher_bounded import safetensors_file

    upgrade(settings.db_url)
    s = dataclasses.replace(settings, scan_interval=0.2)
    (tmp_path / "runs" / "a-big").mkdir()
    (tmp_path / "runs" / "b").mkdir()
    safetensors_file(tmp_path / "runs" / "a-big" / "step_1.safetensors", 1)
    real = catalog.hash_checkpoint
    big_started, release = threading.Event(), threading.Event()

    def hash_checkpoint(run, path, entries, **kw):
        if Path(run).name == "a-big":  # a big hash: 10 s (released at the end of the test)
            big_started.set()
            release.wait(timeout=10)
        return real(run, path, entries, **kw)

    monkeypatch.setattr(catalog, "hash_checkpoint", hash_checkpoint)
    w = Watcher(s, lambda sends: None, use_events=False)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        assert big_started.wait(10)
        safetensors_file(tmp_path / "runs" / "b" / "step_5.safetensors", 5)  # saved during the big hash
        deadline, seen = time.monotonic() + 4, False
        while time.monotonic() < deadline and not seen:
            with session_scope(s.db_url, readonly=True) as ses:
                seen = any(Path(c.run).name == "b" for c in ses.scalars(select(Checkpoint)))
            time.sleep(0.1)
        assert seen, "run b's new save was not detected in 4 s (scan interval 0.2 s) while run a-big hashed"
    finally:
        release.set()
        w.stop()
        t.join(20)


# -- host ids: two ids, one queue ------------------------------------------------------------

def test_two_host_ids_never_share_a_queue(settings):
    """hostid accepts any id of up to 255 characters on one line (CKPT_HOST or host-id), but
    host_queue folds every character outside [A-Za-z0-9_.-] to '_' and cuts at 100: 'gpu node 1'
    and 'gpu_node_1' consume one queue. A shard, rotate or restore for one, taken by the other,
    finds itself on the wrong host and sends itself again to the same queue: with the first
    host down, the second bounces it forever (no attempt counted: owner_elsewhere and the
    restore's host check come before begin_step), and require_consumer takes the second's beat
    for the first's."""
    from pipeline.queues import host_queue
    from pipeline.restore import job as restore_job

    upgrade(settings.db_url)
    s = dataclasses.replace(settings, host="gpu_node_1")
    with session_scope(s.db_url) as ses:
        j = create_job(ses, "restore", checkpoint_id=None, params={"dest": "/x", "host": "gpu node 1"}).id
    bounced = restore_job.restore(s, j)  # runs on gpu_node_1: not its host, sent again...
    assert bounced == [Send("restore", (j,))]
    assert host_queue("gpu node 1") != host_queue(s.host_id), "...to the queue it was taken from"
