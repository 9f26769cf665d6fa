"""The control plane broken: scheduler, Redis, duplicate messages, a contended SQLite."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.service.scheduler import resume
from tests.faults.harness import FaultCluster, Table, check_rows, trial
from tests.processes import alive, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def child(c: FaultCluster, name: str) -> int:
    return c.up_info()["children"][name]


def test_scheduler_killed_and_two_schedulers(fault_cluster: FaultCluster, trials: int):
    """The scheduler is what re-drives a killed step: kill both at once. Then run a second
    scheduler beside the first: one leads, the other stands by."""
    c = fault_cluster
    killed = Table.row("SIGKILL scheduler (and the dramatiq worker) mid-store")
    for _ in range(trials):
        c.arm("replicate.commit1.after", "kill")

        def fire() -> None:
            c.new_checkpoint()
            wait_for(lambda: c.fired("replicate.commit1.after"), 30, "the dramatiq worker to die")
            os.kill(child(c, "scheduler"), signal.SIGKILL)

        trial(c, killed, fire, "replicate.commit1.after")

    two = Table.row("two schedulers at once")
    log = c.tmp / "logs" / "scheduler2.log"
    with open(log, "ab") as out:
        extra = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "scheduler"], env=c.env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(trials):
            c.arm("verify.commit1.after", "kill")
            trial(c, two, c.new_checkpoint, "verify.commit1.after")
        assert extra.poll() is None, log.read_text()[-2000:]
        assert "standing by" in log.read_text() or "the leader" in log.read_text(), log.read_text()[-2000:]
    finally:
        extra.terminate()
        try:
            extra.wait(timeout=20)
        except subprocess.TimeoutExpired:
            extra.kill()
            extra.wait()
    check_rows(killed, two)


class Paused:
    """``ckpt up`` stopped (SIGSTOP) so that it does not restart what the test kills."""

    def __init__(self, c: FaultCluster) -> None:
        self.pid = c.up_proc.pid

    def __enter__(self) -> Paused:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        os.kill(self.pid, signal.SIGCONT)


def kill_redis(c: FaultCluster, *, wipe: bool) -> None:
    pid = child(c, "redis")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, "redis to die")
    if wipe:  # restarted empty: its append-only file is gone too
        for p in (c.home / "redis").rglob("*"):
            if p.is_file():
                p.unlink()


def test_redis_killed_and_restarted_empty_and_down_at_detection(fault_cluster: FaultCluster, trials: int):
    c = fault_cluster
    wiped = Table.row("Redis SIGKILLed mid-store, restarted empty")
    down = Table.row("Redis down when a checkpoint appears")
    for _ in range(trials):
        def mid_store() -> None:
            c.arm("replicate.commit1.after", "sleep 1")
            c.new_checkpoint()
            wait_for(lambda: c.fired("replicate.commit1.after"), 30, "replication to start")
            with Paused(c):
                kill_redis(c, wipe=True)

        trial(c, wiped, mid_store, "replicate.commit1.after")

        def at_detection() -> None:
            with Paused(c):
                kill_redis(c, wipe=False)
                c.new_checkpoint()
                wait_for(lambda: c.detected(c.expecting[-1]), 30, "detection while Redis is down")
                time.sleep(1)

        trial(c, down, at_detection, None)
    check_rows(wiped, down)


def test_every_message_delivered_twice_concurrently(fault_cluster: FaultCluster, trials: int):
    """Each time a store job changes state, the messages that continue it are sent twice
    more, so every step runs three times, two of them at once in the worker's threads."""
    c = fault_cluster
    row = Table.row("every message of a store delivered 3 times")
    broker = RedisBroker(url=f"unix://{c.settings.redis_socket}")
    try:
        for _ in range(trials):
            def fire() -> None:
                path = c.new_checkpoint()
                job_id = wait_for(lambda: c.detected(path), 30, "detection")
                seen = set()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with session_scope(c.settings.db_url) as s:
                        job = s.get(Job, job_id)
                        state = job.state
                        sends = resume(s, c.settings, job) if state not in seen else []
                        if state == "verified":
                            older = s.scalars(select(Job.id).where(Job.kind == "store", Job.id < job_id,
                                                                   Job.state == "verified")).all()
                            sends = [*sends, *(("rotate", (j,)) for j in older)]
                    if state not in seen:
                        seen.add(state)
                        for item in sends:
                            actor, args = (item.actor, item.args) if hasattr(item, "actor") else item
                            for _ in range(2):
                                broker.enqueue(Message(queue_name="ckpt", actor_name=actor, args=args,
                                                       kwargs={}, options={}))
                    if state in ("verified", "rotated", "failed", "superseded"):
                        return
                    time.sleep(0.02)

            trial(c, row, fire, None)
    finally:
        broker.close()
    check_rows(row)


def test_sqlite_contention(fault_cluster: FaultCluster, trials: int):
    """A process holding the write lock 2 s at a time and four churning jobs as fast as they
    can, while checkpoints are stored."""
    c = fault_cluster
    row = Table.row("SQLite: write lock held 2 s at a time + 4 churning writers")
    for _ in range(trials):
        procs = []

        def fire() -> None:
            for mode in ("hold", "churn", "churn", "churn", "churn"):
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.faults.contend", c.settings.db_url,
                                               "8", mode], env=c.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, start_new_session=True))
            time.sleep(0.5)
            c.new_checkpoint()
            c.new_checkpoint()

        try:
            trial(c, row, fire, None)
            outs = [p.communicate(timeout=60) for p in procs]
            assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
            assert all(int(o[0]) > 0 for o in outs), outs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    check_rows(row)


def skew(c: FaultCluster, pid: int, seconds: float) -> None:
    (c.points / f"clock.{pid}").write_text(str(seconds))


def unskew(c: FaultCluster, pid: int) -> None:
    (c.points / f"clock.{pid}").unlink(missing_ok=True)


def test_clock_jumps(fault_cluster: FaultCluster, trials: int):
    """One process's wall clock jumps two days forward, or one hour back."""
    c = fault_cluster
    rows = []
    for seconds, label in ((2 * 86400, "forward two days"), (-3600, "back one hour")):
        row = Table.row(f"scheduler clock {label} (and a dramatiq kill)")
        rows.append(row)
        for _ in range(trials):
            c.wait_stable()
            sched = child(c, "scheduler")
            skew(c, sched, seconds)
            c.arm("replicate.commit1.after", "kill")  # needs the skewed scheduler to re-drive it
            try:
                trial(c, row, c.new_checkpoint, "replicate.commit1.after")
            finally:
                unskew(c, sched)

    # A dramatiq worker whose clock is two days ahead: the storage workers refuse its first
    # requests, telling their time; it signs with their time from then on.
    row = Table.row("dramatiq worker clock forward two days")
    rows.append(row)
    for _ in range(trials):
        c.wait_stable()
        worker = c.dramatiq_workers()[0]
        skew(c, worker, 2 * 86400)
        try:
            trial(c, row, c.new_checkpoint, None)
        finally:
            unskew(c, worker)
        assert any(k.startswith("store verified") for k in row.outcomes), row.outcomes
    check_rows(*rows)
