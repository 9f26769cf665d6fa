"""Attack on issue 28 ("never wedged"): orders of events and peer answers no other test names."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import create_job
from pipeline.detection import catalog
from pipeline.steps import Send

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
