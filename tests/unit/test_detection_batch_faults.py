"""A run's backlog recorded in one transaction (pipeline.detection.hashpool, Watcher._record_all),
attacked by orders of events no other test names: the batch's commit failing after every
savepoint succeeded, the send failing after the commit, a save deleted or rewritten between its
hashing and the batch's commit, a step-less final model hashed in the middle of a batch, and a
small run arriving while a big one's backlog is being taken."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import SessionTransaction

from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, DetectionProblem, Job
from pipeline.db.transitions import now
from pipeline.detection import catalog
from pipeline.detection.watcher import Watcher
from pipeline.service.scheduler import expired_work
from pipeline.store.rotation import rotation_candidates
from tests.unit.test_watcher_bounded import _backlog, _backoff_clock, _recording_pool, safetensors_file

S = states.StoreState


def _rows(db, run: Path) -> list[Checkpoint]:
    with session_scope(db.db_url) as s:
        return list(s.scalars(select(Checkpoint).where(Checkpoint.run == str(run)).order_by(Checkpoint.id)))


def _store_jobs(db) -> dict[int, list[Job]]:
    with session_scope(db.db_url) as s:
        out: dict[int, list[Job]] = {}
        for j in s.scalars(select(Job).where(Job.kind == states.JobKind.STORE).order_by(Job.id)):
            out.setdefault(j.checkpoint_id, []).append(j)
        return out


def _age(run: Path, seconds: float, only: str | None = None) -> None:
    """The saves of ``run`` (or ``only``) written ``seconds`` ago."""
    t = time.time_ns() - int(seconds * 1e9)
    for p in run.iterdir():
        if only is None or p.name == only:
            os.utime(p, ns=(t, t))


def _batch_then_scan(w, gate: threading.Event, more: int = 1) -> None:
    """The backlog handed over and recorded as one batch, then ``more`` scans; the watcher closed."""
    try:
        w.scan(wait=False)
        gate.set()
        for _ in range(1 + more):
            w.scan()
    finally:
        w.close()


def _on_record(monkeypatch, name: str, act) -> None:
    """``act()`` runs as the save called ``name`` is recorded: every save of the batch is hashed."""
    real = catalog.record

    def record(session, d, **kw):
        if d.path.name == name:
            act()
        return real(session, d, **kw)

    monkeypatch.setattr(catalog, "record", record)


def test_a_batch_whose_commit_fails_records_none_and_every_save_is_recorded_later(db, tmp_path, monkeypatch):
    """Every savepoint succeeded, then the commit fails (disk full, a lock): nothing is recorded,
    nothing sent, no save is taken as known; each is looked at again and all are recorded."""
    run, w, gate, sends = _backlog(db, tmp_path, monkeypatch, 5)
    armed, fired = [False], []
    _on_record(monkeypatch, "step_5.safetensors", lambda: armed.__setitem__(0, not fired))
    real_commit = SessionTransaction.commit

    def commit(self, *a, **kw):
        if armed[0] and self._parent is None:  # the batch's transaction, its savepoints all released
            armed[0] = False
            fired.append(1)
            raise OperationalError("COMMIT", {}, Exception("database or disk is full"))
        return real_commit(self, *a, **kw)

    monkeypatch.setattr(SessionTransaction, "commit", commit)
    try:
        w.scan(wait=False)
        gate.set()
        with pytest.raises(OperationalError, match="disk is full"):  # the control plane's: the scan's
            w.scan()
        assert _rows(db, run) == [] and sends == []
        assert not any(k.endswith(".safetensors") for k in w.known)
        w.scan()  # looked at again: all of them, hashed again
    finally:
        w.close()
    assert [c.step for c in _rows(db, run)] == [1, 2, 3, 4, 5]
    assert sorted(x.args[0] for batch in sends for x in batch) == [c.id for c in _rows(db, run)]  # each sent once
    with session_scope(db.db_url) as s:
        assert s.scalars(select(DetectionProblem.reason)).all() == []


def test_a_send_that_fails_after_the_commit_leaves_every_job_driven_by_the_scheduler(db, tmp_path, monkeypatch):
    """The batch is committed, then its one send fails (the broker is down): each job is recorded
    once, looked at again without a second job, and the scheduler's lease sweep re-drives each."""
    run, w, gate, _sends = _backlog(db, tmp_path, monkeypatch, 4)
    sent: list[list] = []
    down = [True]

    def send(batch):
        if down[0]:
            raise ConnectionError("redis is down")
        sent.append(batch)

    w.send = send
    clock = _backoff_clock(w)
    try:
        w.scan(wait=False)
        gate.set()
        w.scan()
        rows = _rows(db, run)
        assert [c.step for c in rows] == [1, 2, 3, 4]
        down[0] = False
        clock[0] += 3600
        w.scan()  # looked at again: recorded already, no new job
    finally:
        w.close()
    jobs = _store_jobs(db)
    assert sorted(jobs) == [c.id for c in rows] and all(len(v) == 1 for v in jobs.values())
    assert all(v[0].state == S.DETECTED for v in jobs.values())
    with session_scope(db.db_url) as s:
        assert s.scalars(select(DetectionProblem.reason)).all() == []
        for j in s.scalars(select(Job)):  # their leases ran out with nothing sent
            j.lease_until = now() - timedelta(seconds=1)
    redriven = expired_work(db)
    assert sorted(x.args[0] for x in redriven if x.actor == "shard") == sorted(v[0].id for v in jobs.values())


def test_a_save_deleted_between_its_hashing_and_the_batch_commit_ends_vanished(db, tmp_path, monkeypatch):
    """step_3 is hashed, then deleted before its batch commits: it is recorded, then found gone
    and its store ends ``vanished``; the others, the newest included, are current and detected."""
    run, w, gate, _sends = _backlog(db, tmp_path, monkeypatch, 5)
    _on_record(monkeypatch, "step_1.safetensors", lambda: (run / "step_3.safetensors").unlink())
    _batch_then_scan(w, gate)
    rows = {c.step: c for c in _rows(db, run)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert not rows[3].local_present and all(rows[i].local_present for i in (1, 2, 4, 5))
    jobs = _store_jobs(db)
    assert jobs[rows[3].id][-1].state == S.VANISHED
    assert all(jobs[rows[i].id][-1].state == S.DETECTED for i in (1, 2, 4, 5))


def test_a_save_rewritten_between_its_hashing_and_the_batch_commit_is_recorded_again_as_its_new_content(
        db, tmp_path, monkeypatch):
    """step_3 is hashed, then saved again with other bytes before its batch commits: the version
    recorded with the batch is superseded by the new one at the next scan, never kept current."""
    run, w, gate, _sends = _backlog(db, tmp_path, monkeypatch, 5)
    path = run / "step_3.safetensors"
    _age(run, 100)

    def rewrite() -> None:
        safetensors_file(path, 99, rows=4)  # written now: newer than the version hashed

    _on_record(monkeypatch, "step_1.safetensors", rewrite)
    _batch_then_scan(w, gate)
    with session_scope(db.db_url) as s:
        versions = s.scalars(select(Checkpoint).where(Checkpoint.path == str(path)).order_by(Checkpoint.id)).all()
        assert len(versions) == 2
        old, new = versions
        assert not old.current and new.current and new.local_present
        assert [f.sha256 for f in new.files] == [hashlib.sha256(path.read_bytes()).hexdigest()]
        assert [f.sha256 for f in new.files] != [f.sha256 for f in old.files]
    jobs = _store_jobs(db)
    assert jobs[old.id][-1].state == S.SUPERSEDED and jobs[new.id][-1].state == S.DETECTED


def test_a_step_less_final_model_hashed_in_the_middle_of_a_batch_is_kept_as_the_newest(db, tmp_path, monkeypatch):
    """``model.safetensors`` written last, found (by name) in the middle of the batch's
    numbered saves: recorded with them, it is the newest and rotation never takes it."""
    run, w, gate, sends = _backlog(db, tmp_path, monkeypatch, 3, prefix="checkpoint_")
    for i in (4, 5):  # more saves after it by name, older by time
        safetensors_file(run / f"step_{i}.safetensors", i, rows=4)
    _age(run, 100)
    safetensors_file(run / "model.safetensors", 7, rows=4)
    _age(run, 50, only="model.safetensors")
    _batch_then_scan(w, gate, more=0)
    rows = {c.name: c for c in _rows(db, run)}
    assert [len(b) for b in sends] == [6]
    with session_scope(db.db_url) as s:
        gone = set(rotation_candidates(s, str(run), 1, db.host_id))
    assert rows["model.safetensors"].id not in gone
    assert [n for n in sorted(rows, key=lambda n: rows[n].id)][3] == "model.safetensors"  # in the middle
    assert {n for n, c in rows.items() if c.id in gone} == {"checkpoint_1.safetensors", "checkpoint_2.safetensors",
                                                             "checkpoint_3.safetensors", "step_4.safetensors"}


def test_a_run_with_one_save_waits_at_most_the_save_being_hashed_behind_a_run_with_a_thousand():
    """One thread; run A has 1,000 saves queued and its first being hashed when run B hands over
    its one save: B is hashed next (A's turn ends after the save it was on), and A goes on after."""
    gate, started = threading.Event(), threading.Event()
    pool, recorded, work = _recording_pool(gate, "a0", started)
    try:
        for i in range(1000):
            pool.submit("A", f"a{i}", work(f"a{i}"))
        assert started.wait(timeout=30)
        pool.submit("B", "b0", work("b0"))
        gate.set()
        pool.wait_idle()
    finally:
        pool.close()
    assert recorded[0] == ["a0"] and recorded[1] == ["b0"]
    assert [k for batch in recorded for k in batch] == [f"a{i}" for i in range(1)] + ["b0"] + [
        f"a{i}" for i in range(1, 1000)]
    assert all(len(b) <= 32 for b in recorded)


def test_a_save_hashed_before_a_bigger_than_a_shard_one_is_recorded_before_that_one_is_hashed(
        db, tmp_path, monkeypatch):
    """A small save and, right after it, one larger than a shard (hashed for minutes at real
    sizes): the turn ends before the big one, so the small one is recorded (and its uploads
    start) while the big one is hashed, never only once that has ended. A trainer keeping one
    save deletes the small one as soon as the big one is written: recorded only after the big
    one's hashing, it would never be protected."""
    run = tmp_path / "runs" / "mixed"
    run.mkdir(parents=True)
    safetensors_file(run / "step_1.safetensors", 1, rows=4)
    big = safetensors_file(run / "step_2.safetensors", 2, rows=64)
    assert big.stat().st_size > db.shard_size >= (run / "step_1.safetensors").stat().st_size
    _age(run, 100)
    gate = threading.Event()
    small_recorded_first: list[bool] = []
    real = catalog.hash_checkpoint

    def small_is_recorded() -> bool:
        with session_scope(db.db_url) as s:
            return s.scalar(select(Checkpoint.id).where(Checkpoint.name == "step_1.safetensors")) is not None

    def hash_checkpoint(run, path, entries, **kw):
        if Path(path).name == "step_1.safetensors":
            gate.wait(timeout=30)  # until both are handed over
        else:  # the big one: hashed while the small one is recorded, or after a long wait
            deadline = time.monotonic() + 10
            while not small_is_recorded() and time.monotonic() < deadline:
                time.sleep(0.02)
            small_recorded_first.append(small_is_recorded())
        return real(run, path, entries, **kw)

    monkeypatch.setattr(catalog, "hash_checkpoint", hash_checkpoint)
    w = Watcher(db, lambda batch: None, use_events=False)
    _batch_then_scan(w, gate, more=0)
    assert small_recorded_first == [True]
    assert [c.step for c in _rows(db, run)] == [1, 2]
