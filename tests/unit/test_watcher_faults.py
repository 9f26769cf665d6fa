"""Any error under a run is that run's: reported once, retried with backoff, the others go on.

Given runs in a shared glob root, When one run directory turns unreadable (mode 000, the
watcher running as another user), or one entry answers EIO, or the inotify watch limit
refuses a run's watch, Then the watcher reports that run or entry once (a problem row, one
log line), looks at it again with a doubling delay, keeps detecting the other runs, never
takes an unreadable run's checkpoints as vanished, and clears the problem once it is fixed.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint, DetectionProblem
from pipeline.detection import completeness, faults
from pipeline.detection.hashpool import HashPool
from pipeline.detection.watcher import Watcher
from tests.checkpoints import atomic_save, state_dict

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

#: The watcher as user ``nobody`` (everything imported first: the interpreter's own files
#: may be out of that user's reach). Prints what it saw, as JSON.
CHILD = textwrap.dedent("""
    import json, logging, os, subprocess, sys, time
    from pathlib import Path
    import numpy as np
    from safetensors.numpy import save_file
    from sqlalchemy import select
    from pipeline import settings as settings_mod
    from pipeline.db.engine import dispose_all, session_scope
    from pipeline.db.migrate import upgrade
    from pipeline.db.models import Checkpoint, DetectionProblem
    from pipeline.detection.watcher import Watcher

    top = Path(sys.argv[1])
    runs = top / "runs"
    s = settings_mod.configure(settings_mod.load({
        "home": top / "home", "roots": (str(runs / "*"),), "cluster_key": "k", "redis_url": "stub://",
        "shard_size": 65536, "settle_seconds": 0.0}, environ={}))
    upgrade(s.db_url)
    dispose_all()
    subprocess.run(["chown", "-R", "65534:65534", str(top)], check=True)
    os.setgid(65534)
    os.setuid(65534)
    lines = []

    class Count(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("ckpt.watcher").addHandler(Count())

    def save(path, seed):
        tmp = path.parent / ("." + path.name + ".tmp")
        save_file({"w": np.full((64, 64), seed, dtype=np.float32)}, str(tmp))
        os.rename(tmp, path)
        old = time.time() - 3600
        os.utime(path, (old, old))

    def state():
        with session_scope(s.db_url) as db:
            ckpts = db.scalars(select(Checkpoint))
            return {"ckpts": sorted((c.name, Path(c.run).name, c.local_present) for c in ckpts),
                    "problems": {Path(p.path).name: p.reason for p in db.scalars(select(DetectionProblem))}}

    clock = [1000.0]
    w = Watcher(s, [].extend, use_events=True)
    w.reports.backoff.clock = lambda: clock[0]
    w.reconcile()
    w.watches.start()
    out = {}
    try:
        w.scan()
        out["before"] = state()
        os.chmod(runs / "a", 0)
        save(runs / "b" / "step_2.safetensors", 2)
        tries = []
        for _ in range(6):  # the clock moves past each delay: every scan is a try
            w.scan()
            tries.append(w.reports.backoff._failed[str(runs / "a")].delay)
            clock[0] += 1000
        out["failing"] = state()
        restarted = Watcher(s, [].extend, use_events=False)
        restarted.reconcile()  # a watcher starting while the run is unreadable: nothing of it vanished
        out["restarted"] = state()["ckpts"]
        out["delays"] = tries
        out["lines"] = [line for line in lines if "/runs/a" in line]
        os.chmod(runs / "a", 0o755)  # fixed: its metadata changed, looked at again at once
        clock[0] += 1
        save(runs / "a" / "step_3.safetensors", 3)
        w.scan()
        out["fixed"] = state()
    finally:
        w.watches.stop()
    print(json.dumps(out))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the watcher as another user")
def test_an_unreadable_run_as_a_non_root_watcher_is_reported_once_and_the_others_are_detected():
    top = Path(tempfile.mkdtemp(prefix="ckpt-faults-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        for run in ("a", "b"):
            (top / "runs" / run).mkdir(parents=True)
            atomic_save(state_dict(ord(run)), top / "runs" / run / "step_1.safetensors")
            old = time.time() - 3600
            os.utime(top / "runs" / run / "step_1.safetensors", (old, old))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("CKPT_FAILPOINTS", None)
        done = subprocess.run([sys.executable, "-c", CHILD, str(top)], cwd=str(top), env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(top)], check=False)
        shutil.rmtree(top, ignore_errors=True)

    assert out["before"]["ckpts"] == [["step_1.safetensors", "a", True], ["step_1.safetensors", "b", True]]
    failing = out["failing"]
    # The other run goes on; the unreadable run's checkpoint is not taken as vanished.
    assert failing["ckpts"] == [["step_1.safetensors", "a", True], ["step_1.safetensors", "b", True],
                                ["step_2.safetensors", "b", True]]
    assert out["restarted"] == failing["ckpts"]
    assert "permission denied" in failing["problems"]["a"] and "uid 65534" in failing["problems"]["a"]
    assert len(out["lines"]) == 1, out["lines"]  # reported once, whatever the number of tries
    assert out["delays"] == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0]  # tried again, each time later
    fixed = out["fixed"]
    assert ["step_3.safetensors", "a", True] in fixed["ckpts"]
    assert "a" not in fixed["problems"]


def test_an_entry_answering_eio_is_reported_once_and_retried_while_its_run_goes_on(db, tmp_path, monkeypatch, caplog):
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    bad = atomic_save(state_dict(1), run / "step_1.safetensors")
    good = atomic_save(state_dict(2), run / "step_2.safetensors")
    real = completeness.examine
    broken = {str(bad)}
    looks: list[str] = []

    def examine(path, **kw):
        looks.append(path.name)
        if str(path) in broken:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, **kw)

    monkeypatch.setattr(completeness, "examine", examine)
    clock = [0.0]
    w = Watcher(db, [].extend, use_events=False)
    w.reports.backoff.clock = lambda: clock[0]
    with caplog.at_level(logging.ERROR, logger="ckpt.watcher"):
        w.scan()
        w.scan()  # within its delay: not looked at
        clock[0] += faults.FIRST_SECONDS
        w.scan()  # due: tried again, fails again
    assert looks.count("step_1.safetensors") == 2
    with session_scope(db.db_url) as s:
        assert [c.name for c in s.scalars(select(Checkpoint))] == [good.name]
        (problem,) = s.scalars(select(DetectionProblem)).all()
    assert problem.path == str(bad) and "Input/output error" in problem.reason
    assert len([r for r in caplog.records if "step_1" in r.getMessage()]) == 1
    broken.clear()
    clock[0] += 2 * faults.FIRST_SECONDS
    w.scan()
    with session_scope(db.db_url) as s:
        assert sorted(c.name for c in s.scalars(select(Checkpoint))) == [bad.name, good.name]
        assert s.scalars(select(DetectionProblem)).all() == []


def test_a_database_error_applying_one_hashed_entry_keeps_the_others_finished_with_it(settings):
    """Entries hashed by the pool are applied in one batch at the start of a scan. One whose
    recording hit a control-plane error (SQLite 'database is locked' under contention) ends the
    scan, but only once the batch's other entries, taken out of the pool already, are applied:
    else their checkpoints are recorded without the watcher knowing it, and each is hashed
    again, whole (up to CKPT_MAX_HASH_BYTES per file), at the next scan."""
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


def test_a_run_whose_watch_hits_the_inotify_limit_is_reported_once_and_still_detected(db, tmp_path, caplog):
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir()
    limited = {str((tmp_path / "runs" / "a").resolve())}
    w = Watcher(db, [].extend, use_events=True)
    clock = [0.0]
    w.watches.backoff.clock = lambda: clock[0]
    real = w.watches.observer.schedule
    tried: list[str] = []

    def schedule(handler, path, **kw):
        tried.append(path)
        if path in limited:
            raise OSError(errno.ENOSPC, "inotify watch limit reached")
        return real(handler, path, **kw)

    w.watches.observer.schedule = schedule
    w.watches.start()
    try:
        with caplog.at_level(logging.ERROR, logger="ckpt.watcher"):
            w.scan()
            atomic_save(state_dict(1), tmp_path / "runs" / "a" / "step_1.safetensors")
            w.scan()
            clock[0] += faults.FIRST_SECONDS
            w.scan()
        assert tried.count(next(iter(limited))) == 2  # tried again after the delay, not at every scan
        with session_scope(db.db_url) as s:
            assert [c.name for c in s.scalars(select(Checkpoint))] == ["step_1.safetensors"]  # by the scan
            (problem,) = s.scalars(select(DetectionProblem)).all()
        assert problem.path == next(iter(limited)) and "inotify watch limit" in problem.reason
        assert len([r for r in caplog.records if "inotify" in r.getMessage()]) == 1
        limited.clear()
        clock[0] += 2 * faults.FIRST_SECONDS
        w.scan()
        with session_scope(db.db_url) as s:
            assert s.scalars(select(DetectionProblem)).all() == []
    finally:
        w.watches.stop()


def test_backoff_doubles_up_to_its_most_and_a_changed_path_is_due_at_once(tmp_path):
    clock = [0.0]
    b = faults.Backoff(first=5, most=30, clock=lambda: clock[0])
    path = str(tmp_path)
    assert [b.failed(path) for _ in range(5)] == [5, 10, 20, 30, 30]
    assert b.wait(path) == 30
    clock[0] += 29
    assert b.wait(path) == pytest.approx(1)
    os.chmod(tmp_path, 0o750)  # its metadata changed: due now
    assert b.wait(path) is None
    assert b.succeeded(path) and b.wait(path) is None and not b.succeeded(path)
