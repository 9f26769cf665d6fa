"""Bounded detection work: one run's hashing never holds up another run's detection.

Given a run holding a 100 TB sparse file (``truncate -s 100T`` behind a valid safetensors
header) and a run holding a normal safetensors checkpoint, When the watcher scans, Then the
normal one is recorded in that scan and the sparse one is reported once with the reason and
the setting to change, and never hashed. Given a run whose big checkpoint is being hashed,
Then another run's checkpoint is recorded before that hash ends (by the order of events, not
by the clock).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint, DetectionProblem
from pipeline.detection import catalog
from pipeline.detection.hashpool import HashPool, Staged
from pipeline.detection.watcher import Watcher
from pipeline.service import readiness

TB = 1000**4


def safetensors_file(path: Path, seed: int, rows: int = 64) -> Path:
    """A normal checkpoint, written by the safetensors library (temporary name, then rename)."""
    tmp = path.parent / f".{path.name}.tmp"
    save_file({"w": np.full((rows, 1024), seed, dtype=np.float32)}, str(tmp))
    os.rename(tmp, path)
    return path


def sparse_safetensors(path: Path) -> int:
    """A structurally complete safetensors file of 100 TB (15 TB where the filesystem stops
    there, as ext4 does) that holds no data blocks: its size."""
    for size in (100 * TB, 15 * TB):
        header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
        header += b" " * (-len(header) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            try:
                f.truncate(8 + len(header) + size)
            except OSError as exc:
                if exc.errno != errno.EFBIG:
                    raise
                continue
        return 8 + len(header) + size
    raise AssertionError("no sparse file could be made here")


@pytest.fixture
def hashed(monkeypatch):
    """The paths the watcher hashes, in the order their hashing starts."""
    real = catalog.hash_checkpoint
    paths: list[str] = []

    def hash_checkpoint(run, path, entries, **kw):
        paths.append(Path(path).name)
        if any(e.size > TB for e in entries):
            raise AssertionError(f"{path}: a sparse file was hashed")
        return real(run, path, entries, **kw)

    monkeypatch.setattr(catalog, "hash_checkpoint", hash_checkpoint)
    return paths


def test_a_sparse_file_is_reported_once_never_hashed_and_the_other_run_is_detected(db, tmp_path, hashed, caplog):
    (tmp_path / "runs" / "huge").mkdir()
    (tmp_path / "runs" / "normal").mkdir()
    size = sparse_safetensors(tmp_path / "runs" / "huge" / "step_1.safetensors")
    safetensors_file(tmp_path / "runs" / "normal" / "step_1.safetensors", 1)
    w = Watcher(db, [].extend, use_events=False)
    with caplog.at_level(logging.ERROR, logger="ckpt.watcher"):
        w.scan()
        with session_scope(db.db_url) as s:
            recorded = [Path(c.run).name for c in s.scalars(select(Checkpoint))]
        w.scan()
        w.scan()
    assert recorded == ["normal"]  # in the first scan
    assert hashed == ["step_1.safetensors"]  # the normal one only
    with session_scope(db.db_url) as s:
        (problem,) = s.scalars(select(DetectionProblem)).all()
    assert Path(problem.run).name == "huge"
    assert "sparse file" in problem.reason and f"{size:,} bytes" in problem.reason
    assert "CKPT_SPARSE_RATIO=0" in problem.reason
    assert len([r for r in caplog.records if "huge" in r.getMessage()]) == 1


def test_a_file_over_max_hash_bytes_is_reported_and_protected_once_the_limit_allows_it(db, tmp_path, hashed):
    run = tmp_path / "runs" / "r"
    run.mkdir()
    ckpt = safetensors_file(run / "step_1.safetensors", 1)
    w = Watcher(dataclasses.replace(db, max_hash_bytes=1000), [].extend, use_events=False)
    w.scan()
    with session_scope(db.db_url) as s:
        assert s.scalars(select(Checkpoint)).all() == []
        (problem,) = s.scalars(select(DetectionProblem)).all()
    assert "more than max_hash_bytes (1,000)" in problem.reason and "CKPT_MAX_HASH_BYTES" in problem.reason
    assert hashed == []
    w.settings = dataclasses.replace(db, max_hash_bytes=ckpt.stat().st_size)
    w.scan()
    with session_scope(db.db_url) as s:
        assert [c.name for c in s.scalars(select(Checkpoint))] == [ckpt.name]
        assert s.scalars(select(DetectionProblem)).all() == []


def test_a_big_checkpoint_being_hashed_does_not_delay_another_runs(db, tmp_path, monkeypatch):
    """The big run's hash is held open until the other run's checkpoint is recorded: with
    hashing on the scan thread, the other run waited for it (the order below reversed)."""
    (tmp_path / "runs" / "a-big").mkdir()
    (tmp_path / "runs" / "b-small").mkdir()
    big = safetensors_file(tmp_path / "runs" / "a-big" / "step_1.safetensors", 1, rows=16 * 1024)  # 64 MiB
    safetensors_file(tmp_path / "runs" / "b-small" / "step_1.safetensors", 2)
    real = catalog.hash_checkpoint
    events: list[str] = []
    big_started, small_recorded = threading.Event(), threading.Event()

    def hash_checkpoint(run, path, entries, **kw):
        name = Path(run).name
        if name == "a-big":
            events.append(f"{name} hashing")
            big_started.set()
            small_recorded.wait(timeout=10)  # the big hash is still going while the other run is looked at
        else:
            big_started.wait(timeout=10)
            events.append(f"{name} hashing")
        d = real(run, path, entries, **kw)
        events.append(f"{name} hashed")
        return d

    monkeypatch.setattr(catalog, "hash_checkpoint", hash_checkpoint)
    sent: list = []

    def send(messages):  # right after a checkpoint is recorded
        sent.extend(messages)
        events.append("recorded")
        small_recorded.set()

    w = Watcher(db, send, use_events=False)
    w.scan()
    assert events == ["a-big hashing", "b-small hashing", "b-small hashed", "recorded", "a-big hashed",
                      "recorded"], events
    with session_scope(db.db_url) as s:
        assert sorted(Path(c.run).name for c in s.scalars(select(Checkpoint))) == ["a-big", "b-small"]
    assert big.stat().st_size > 64 * 1024 * 1024


def test_a_save_made_while_a_big_checkpoint_is_hashed_at_start_is_detected_meanwhile(settings, tmp_path,
                                                                                       monkeypatch):
    """The watcher's first scan waited for every hash it started: a watcher (re)started beside a
    big unrecorded checkpoint looked at no run again, reported its host in no more, and was not
    ready, until that hash ended. A save in another run meanwhile waited for it (a trainer's
    save_total_limit may delete it before it is ever seen). Now it is ready, and scans on, once
    the first scan handed its work to the pool."""
    upgrade(settings.db_url)
    s = dataclasses.replace(settings, scan_interval=0.2, ready_dir=str(tmp_path / "ready"))
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
        deadline = time.monotonic() + 4
        while not readiness.ready(tmp_path / "ready", "watcher") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert readiness.ready(tmp_path / "ready", "watcher") == 1, "not ready while the big hash goes on"
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


def test_the_pool_serves_runs_in_turn_one_checkpoint_each():
    """Run A hands over three checkpoints, then run B one: B's is hashed second, not fourth."""
    order: list[str] = []
    gate = threading.Event()
    pool = HashPool(1)

    def work(name: str):
        def go():
            if name == "a1":
                gate.wait(timeout=30)
            order.append(name)
            return lambda: None
        return go

    for name in ("a1", "a2", "a3"):
        pool.submit("A", name, work(name))
    pool.submit("B", "b1", work("b1"))
    pool.submit("A", "a2", work("a2"))  # already queued: not twice
    assert pool.busy("a3") and pool.busy("b1")
    gate.set()
    pool.wait_idle()
    assert order == ["a1", "b1", "a2", "a3"]
    assert [key for _run, key, _apply in pool.finished()] == order
    assert not pool.busy("a1")
    pool.close()


def _recording_pool(gate: threading.Event, gated: str, started: threading.Event | None = None):
    """A one-thread pool whose record keeps each batch's keys, and the work it is given: work
    ``name`` stages ``name``; ``gated``'s waits for ``gate`` (``started`` is set as it begins)."""
    recorded: list[list[str]] = []

    def record(items):
        recorded.append(list(items))
        return [lambda: None for _ in items]

    def work(name: str):
        def go():
            if name == gated:
                if started is not None:
                    started.set()
                gate.wait(timeout=30)
            return Staged(name)
        return go

    return HashPool(1, record=record), recorded, work


def test_a_runs_backlog_is_taken_in_one_turn_and_recorded_together_in_the_order_found():
    """While no other run waits, the lane's thread goes on with its run's next checkpoints and
    records what they staged in one call, in the order they were found."""
    gate = threading.Event()
    pool, recorded, work = _recording_pool(gate, "a1")
    for name in ("a1", "a2", "a3", "a4"):
        pool.submit("A", name, work(name))
    gate.set()
    pool.wait_idle()
    assert recorded == [["a1", "a2", "a3", "a4"]]
    assert [key for _run, key, _apply in pool.finished()] == ["a1", "a2", "a3", "a4"]
    pool.close()


def _backoff_clock(w: Watcher) -> list[float]:
    """The clock of ``w``'s backoff, moved by hand: ``clock[0] += 3600`` ends every backoff."""
    clock = [0.0]
    w.reports.backoff.clock = lambda: clock[0]
    return clock


def _backlog(db, tmp_path, monkeypatch, n: int, prefix: str = "step_"):
    """``n`` saves in one run (``{prefix}{i}.safetensors``), and a watcher whose first hash waits
    until all are handed over (a run that saved faster than it is recorded)."""
    run = tmp_path / "runs" / "fast"
    run.mkdir(parents=True)
    for i in range(1, n + 1):
        safetensors_file(run / f"{prefix}{i}.safetensors", i, rows=4)
    gate = threading.Event()
    real = catalog.hash_checkpoint

    def hash_checkpoint(run, path, entries, **kw):
        if Path(path).name == f"{prefix}1.safetensors":
            gate.wait(timeout=30)
        return real(run, path, entries, **kw)

    monkeypatch.setattr(catalog, "hash_checkpoint", hash_checkpoint)
    sends: list[list] = []
    w = Watcher(db, sends.append, use_events=False)
    return run, w, gate, sends


def test_saves_of_one_run_in_flight_together_are_recorded_in_one_go_and_ranked_in_order(db, tmp_path, monkeypatch):
    """Six saves handed over while the first is hashed are recorded as one batch: one send of
    their six shard messages, in the order of the saves, and detection order (the tie-break of
    "newest") follows the steps, so rotation keeps the newest and never ranks an older one above."""
    from pipeline.store.rotation import rotation_candidates

    run, w, gate, sends = _backlog(db, tmp_path, monkeypatch, 6)
    try:
        w.scan(wait=False)
        gate.set()
        w.scan()
    finally:
        w.close()
    assert len(sends) == 1 and [x.actor for x in sends[0]] == ["shard"] * 6
    with session_scope(db.db_url) as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.run == str(run)).order_by(Checkpoint.id)).all()
        assert [c.step for c in rows] == [1, 2, 3, 4, 5, 6]
        assert [x.args[0] for x in sends[0]] == [c.id for c in rows]  # one job per checkpoint, same order
        gone = rotation_candidates(s, str(run), 3, db.host_id)
        assert sorted(s.get(Checkpoint, i).step for i in gone) == [1, 2, 3]


def _refuse(session) -> None:
    """What the control plane refuses (its own error, the transaction still usable): a row
    without the values it requires."""
    session.add(Checkpoint(path=None))
    session.flush()


def _raise(session) -> None:
    raise ValueError("step_3 cannot be recorded")


@pytest.mark.parametrize("fail, said", [(_raise, "step_3 cannot be recorded"), (_refuse, "IntegrityError")])
def test_a_save_that_cannot_be_recorded_fails_alone_and_its_batch_is_recorded(db, tmp_path, monkeypatch, fail, said):
    """One save of a batch whose record fails is reported and looked at again later, by itself;
    the batch's other saves are recorded and sent. A database error of that save alone (its
    savepoint rolled back, the batch committed) is that save's, not the control plane's: the
    scan goes on, and the save is reported with backoff, not hashed again at every scan."""
    run, w, gate, sends = _backlog(db, tmp_path, monkeypatch, 5)
    real = catalog.record

    def record(session, d, **kw):
        out = real(session, d, **kw)
        if d.path.name == "step_3.safetensors":  # after its rows were written: none of them may stay
            fail(session)
        return out

    monkeypatch.setattr(catalog, "record", record)
    clock = _backoff_clock(w)
    try:
        w.scan(wait=False)
        gate.set()
        w.scan()
        with session_scope(db.db_url) as s:
            steps = sorted(c.step for c in s.scalars(select(Checkpoint).where(Checkpoint.run == str(run))))
            problem = s.scalar(select(DetectionProblem.reason)
                               .where(DetectionProblem.path.endswith("step_3.safetensors")))
        assert steps == [1, 2, 4, 5] and [len(batch) for batch in sends] == [4]
        assert problem is not None and said in problem

        monkeypatch.setattr(catalog, "record", real)
        clock[0] += 3600  # its backoff is over
        w.scan()
    finally:
        w.close()
    with session_scope(db.db_url) as s:
        steps = sorted(c.step for c in s.scalars(select(Checkpoint).where(Checkpoint.run == str(run))))
        assert steps == [1, 2, 3, 4, 5]
        assert s.scalar(select(DetectionProblem.reason)) is None
