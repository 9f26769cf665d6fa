"""The scheduler's leader lock and lease re-drive."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.db.transitions import create_job, now
from pipeline.service import scheduler
from pipeline.service.scheduler import (
    acquire_lock,
    expired_work,
    holder_is_dead,
    release_lock,
)
from pipeline.steps import Send


def test_only_one_scheduler_holds_the_leader_lock(db):
    assert acquire_lock(db, "scheduler", "a", ttl=30)
    assert not acquire_lock(db, "scheduler", "b", ttl=30)
    assert acquire_lock(db, "scheduler", "a", ttl=30)  # renewal
    release_lock(db, "scheduler", "a")
    assert acquire_lock(db, "scheduler", "b", ttl=30)


def test_an_expired_lock_is_taken_over(db):
    assert acquire_lock(db, "scheduler", "a", ttl=-1)
    assert acquire_lock(db, "scheduler", "b", ttl=30)


def _job(s, kind: str, state: str, expired: bool) -> int:
    job = create_job(s, kind, checkpoint_id=None)
    job.state = state
    job.lease_until = now() + timedelta(seconds=-5 if expired else 60)
    s.flush()
    return job.id


def test_a_dead_local_holder_is_taken_over_at_once(db):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    assert acquire_lock(db, "scheduler", f"{host}:{gone.pid}", ttl=30)
    assert holder_is_dead(f"{host}:{gone.pid}")
    assert acquire_lock(db, "scheduler", "b", ttl=30)  # no need to wait 30 s


def test_a_live_or_remote_holder_is_not_presumed_dead(db):
    host = socket.gethostname()
    parent = f"{host}:{os.getppid()}"
    assert not holder_is_dead(parent)
    assert not holder_is_dead("another-host:1")
    assert not holder_is_dead("garbage")
    assert acquire_lock(db, "scheduler", parent, ttl=30)
    assert not acquire_lock(db, "scheduler", "b", ttl=30)


def test_expired_leases_are_re_driven_by_state_and_kind(db):
    with session_scope(db.db_url) as s:
        detected = _job(s, "store", "detected", expired=True)
        replicated = _job(s, "store", "replicated", expired=True)
        store_verified = _job(s, "store", "verified", expired=True)  # waiting for rotation: not active
        restore_verified = _job(s, "restore", "verified", expired=True)  # renaming into place: active
        fresh = _job(s, "store", "detected", expired=False)
    sends = expired_work(db)
    assert set(sends) == {Send("shard", (detected,)), Send("verify", (replicated,)),
                          Send("restore", (restore_verified,))}
    with session_scope(db.db_url) as s:
        assert s.get(Job, detected).lease_until > now()
        assert store_verified not in {a for x in sends for a in x.args} and fresh
    assert expired_work(db) == []  # the renewed leases hold


def test_a_lease_written_by_a_fast_clock_is_not_trusted(db):
    with session_scope(db.db_url) as s:
        ahead = _job(s, "store", "detected", expired=False)
        s.get(Job, ahead).lease_until = now() + timedelta(days=2)
    assert expired_work(db) == [Send("shard", (ahead,))]
    assert expired_work(db) == []  # re-leased from this clock


def test_a_leader_lock_written_by_a_fast_clock_is_taken_over(db):
    assert acquire_lock(db, "scheduler", "fast", ttl=30)
    from pipeline.db.models import Lock

    with session_scope(db.db_url) as s:
        s.get(Lock, "scheduler").expires_at = now() + timedelta(days=2)
    assert acquire_lock(db, "scheduler", "b", ttl=30)


def test_a_leader_whose_lock_lapsed_while_it_probed_acts_on_nothing(db, monkeypatch):
    """A probe may take as long as the leader lock's lease (CKPT_PROBE_SECONDS per exchange):
    if another scheduler took the lock meanwhile, this one must not go on to re-drive, rotate
    or repair beside it."""
    from pipeline.cluster.membership import ProbeResult
    from pipeline.db.models import Lock

    with session_scope(db.db_url) as s:
        _job(s, "store", "detected", expired=True)
    sent: list[Send] = []
    sched = scheduler.Scheduler(db, sent.extend)

    def probe(settings) -> ProbeResult:  # outlasts the lease; another scheduler takes over
        with session_scope(db.db_url) as s:
            s.get(Lock, scheduler.LEADER).expires_at = now() - timedelta(seconds=1)
        assert acquire_lock(db, scheduler.LEADER, "another-host:1", ttl=10)
        return ProbeResult()

    monkeypatch.setattr(scheduler, "probe_all", probe)
    sched.tick()
    assert sent == [], "a scheduler that no longer leads re-drove work"
    assert sched.leader is False


def test_the_leader_optimizes_sqlite_at_start_and_every_optimize_hours(settings):
    """Planner statistics (``sqlite_stat1``) are written at the leader's first tick, not again
    before ``optimize_hours``, and again after."""
    import dataclasses

    from pipeline.db.engine import get_engine
    from pipeline.db.migrate import upgrade
    from tests.unit.test_migrations import insert_checkpoint

    upgrade(settings.db_url)
    with get_engine(settings.db_url).connect() as conn:
        for i in range(1, 21):
            insert_checkpoint(conn, i)
        conn.commit()

    def stats() -> list[str]:
        with get_engine(settings.db_url).connect() as conn:
            if not conn.exec_driver_sql("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_stat1'").all():
                return []
            return sorted({t for (t,) in conn.exec_driver_sql("SELECT tbl FROM sqlite_stat1")})

    def forget_stats() -> None:
        with get_engine(settings.db_url).connect() as conn:
            conn.exec_driver_sql("DELETE FROM sqlite_stat1")
            conn.commit()

    clock = [1000.0]
    sched = scheduler.Scheduler(dataclasses.replace(settings, optimize_hours=6.0), [].extend, clock=lambda: clock[0])
    assert stats() == []
    sched.tick()
    assert "checkpoints" in stats()
    forget_stats()
    clock[0] += 5 * 3600
    sched.tick()
    assert stats() == [], "optimized again before optimize_hours"
    clock[0] += 3600
    sched.tick()
    assert "checkpoints" in stats()
