"""A host outage piles nothing up; the host returns and its stores complete once.

A real cluster (`ckpt up`: embedded Redis, real Dramatiq worker processes, the scheduler, the
watcher) with a short lease. The host's Dramatiq processes are stopped (SIGSTOP: its queues
have no live consumer) while a checkpoint is written, for several lease periods: each lease
the scheduler re-drives the store, and nothing may pile up in Redis. Then they continue.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter

import pytest
import redis
from dramatiq import Message
from sqlalchemy import select
from sqlalchemy.engine import make_url

from pipeline import consumers
from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, ContentCopy, Job, QueueConsumer, Shard, TrainingHost
from pipeline.queues import SHARED, depths, host_queue
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration
LEASE = 2.0
OUTAGE_LEASES = 6


def _messages_per_step(client: redis.Redis, queues: list[str]) -> Counter[tuple[str, object]]:
    """(actor, first argument) -> messages for it in ``queues`` (waiting, in flight or delayed)."""
    steps: Counter[tuple[str, object]] = Counter()
    for q in queues:
        for key in (f"dramatiq:{q}.msgs", f"dramatiq:{q}.DQ.msgs"):
            for body in client.hvals(key):
                m = Message.decode(body)
                steps[(m.actor_name, m.args[0] if m.args else None)] += 1
    return steps


def _children(parent: int) -> list[int]:
    """Every process whose parent is ``parent``, forked from any of its threads."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _stop_tree(master: int) -> list[int]:
    """SIGSTOP ``master`` first, so that it forks no worker after its children were listed; then
    every process whose parent it is (forked from any of its threads), until no new one appears."""
    os.kill(master, signal.SIGSTOP)
    stopped = [master]
    while new := [pid for pid in _children(master) if pid not in stopped]:
        for pid in new:
            os.kill(pid, signal.SIGSTOP)
        stopped += new
    return stopped


def _write_locked(db_url: str) -> bool:
    """Whether some process holds the SQLite control plane's write lock (for longer than 0.5 s)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(make_url(db_url).database, timeout=0.5,
                                            isolation_level=None)) as c:
        try:
            c.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return True
            raise
        c.execute("ROLLBACK")
        return False


def _states(pids: list[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                out[pid] = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            out[pid] = "gone"
    return out


def test_a_host_outage_piles_nothing_up_and_its_store_completes_once_it_returns(make_cluster):
    cluster = make_cluster(env={"CKPT_LEASE_SECONDS": str(LEASE), "CKPT_CONSUMER_BEAT_SECONDS": "0.3",
                                "CKPT_MAX_ATTEMPTS": "3"})
    settings = cluster.settings
    mine = host_queue(settings.host_id)
    queues = [SHARED, mine]

    def consumed() -> bool:
        with session_scope(settings.db_url, readonly=True) as s:
            return mine in consumers.live(s, settings)

    wait_for(consumed, 30, "the host's Dramatiq workers to say they consume its queue")
    master = cluster.up_info()["children"]["dramatiq"]
    client = redis.Redis.from_url(settings.broker_url)
    stopped: list[int] = []
    try:
        # Given the host's workers stopped: its queues have no live consumer.
        # A process stopped inside a write transaction (a beat: every 0.3 s) would hold SQLite's
        # one write lock through the outage, and no other process could write, the watcher's
        # report included: the queue's last beat would stay the newest sign of life, never
        # silent (consumers.live_since). Hosts on other machines share a PostgreSQL control
        # plane, where a frozen host's open transaction locks only its own rows (its queue's
        # beat, its host's report); here every process shares one SQLite file and its one lock,
        # so the host's processes are continued and stopped again until none holds it.
        for _ in range(50):
            stopped += _stop_tree(master)
            # A signal is delivered once the process leaves the system call it is in (one that
            # takes the lock, say): probed only once every one of them is stopped.
            wait_for(lambda: all(state in ("T", "gone") for state in _states(stopped).values()), 10,
                     "the host's Dramatiq processes to stop")
            if not _write_locked(settings.db_url):
                break
            for pid in reversed(stopped):
                os.kill(pid, signal.SIGCONT)
            stopped.clear()
            time.sleep(0.05)
        else:
            raise AssertionError("the stopped Dramatiq processes held the control plane's write lock 50 times")

        def silent() -> bool:
            with session_scope(settings.db_url, readonly=True) as s:
                return mine in consumers.silent(s, settings, [mine])

        try:
            wait_for(silent, 30, "the host's queue to have no live consumer")
        except AssertionError as exc:  # say who still beats, for the next look at it
            with session_scope(settings.db_url, readonly=True) as s:
                beats = [(c.queue, c.host, str(c.seen_at)) for c in s.scalars(select(QueueConsumer))]
                reports = [(h.name, str(h.last_seen)) for h in s.scalars(select(TrainingHost))]
            raise AssertionError(f"{exc}; beats {beats}; host reports {reports}; stopped {_states(stopped)}; "
                                 f"the master's children now {_states(_children(master))}") from None
        run = cluster.runs / "r1"
        run.mkdir()
        path = atomic_save(state_dict(seed=3, layers=4, width=160), run / "step_1.safetensors")
        job_id = checkpoint_job(cluster, path)

        # When the outage lasts several lease periods, each re-driving the store...
        worst: Counter[tuple[str, object]] = Counter()
        deepest = 0
        end = time.monotonic() + OUTAGE_LEASES * LEASE
        while time.monotonic() < end:
            worst |= _messages_per_step(client, queues)
            deepest = max(deepest, sum(depths(client).get(q, 0) for q in queues))
            time.sleep(0.2)
        with session_scope(settings.db_url) as s:
            waiting = s.get(Job, job_id)
            assert waiting is not None
            state, waiting_for, reason = waiting.state, waiting.waiting_for, waiting.blocked_reason
    finally:
        for pid in reversed(stopped):
            os.kill(pid, signal.SIGCONT)

    # ...then at most one message per step was ever queued, and the job said what it waits for.
    assert all(n <= 1 for n in worst.values()), worst
    assert deepest <= 1, deepest
    assert waiting_for == mine, (state, waiting_for, reason)
    assert reason is not None and reason.startswith(f"waiting for host {settings.host_id} since "), reason

    # When the host's workers continue, the store completes, verified, once.
    job = cluster.wait_job(job_id, ("verified", "rotated"), timeout=120)
    assert job.attempts <= 1, job.attempts
    assert job.waiting_for is None
    with session_scope(settings.db_url, readonly=True) as s:
        events = [(e.to_state, e.detail) for e in s.get(Job, job_id).events]
        shas = select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == job.checkpoint_id)
        attempts = s.scalars(select(ContentCopy.attempts).where(ContentCopy.sha256.in_(shas))).all()
    assert "failed" not in [to for to, _ in events], events
    assert attempts and all(a == 1 for a in attempts), attempts  # each copy sent once
    assert client.zcard(f"dramatiq:{SHARED}.XQ") == 0 and client.zcard(f"dramatiq:{mine}.XQ") == 0
