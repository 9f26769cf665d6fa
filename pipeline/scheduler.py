"""The scheduler: one leader-locked loop that keeps the pipeline moving.

Every tick it renews its leader lease, probes the storage workers, and re-drives every
job whose lease expired (a killed Dramatiq worker or a wiped Redis delays work, never
loses it: DESIGN invariant 3). Now and then it also asks each run to apply rotation.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

from sqlalchemy import and_, or_, select, update
from sqlalchemy.exc import IntegrityError

from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Job, Lock, Replica, Shard
from pipeline.db.transitions import now
from pipeline.membership import probe_all
from pipeline.settings import Settings
from pipeline.steps import Send

log = logging.getLogger("ckpt.scheduler")
S, R = states.StoreState, states.RestoreState
LEADER = "scheduler"


def acquire_lock(settings: Settings, name: str, holder: str, ttl: float) -> bool:
    """Take or renew the named lease; True while ``holder`` has it."""
    t = now()
    with session_scope(settings.db_url) as s:
        took = s.execute(
            update(Lock).where(Lock.name == name, (Lock.holder == holder) | (Lock.expires_at < t))
            .values(holder=holder, expires_at=t + timedelta(seconds=ttl))
        ).rowcount
        if took:
            return True
        if s.get(Lock, name) is not None:
            return False
    try:
        with session_scope(settings.db_url) as s:
            s.add(Lock(name=name, holder=holder, expires_at=t + timedelta(seconds=ttl)))
        return True
    except IntegrityError:
        return False


def release_lock(settings: Settings, name: str, holder: str) -> None:
    with session_scope(settings.db_url) as s:
        s.execute(update(Lock).where(Lock.name == name, Lock.holder == holder).values(expires_at=now()))


def expired_work(settings: Settings) -> list[Send]:
    """Renew the lease of every active job whose lease expired; the messages that resume them."""
    t = now()
    sends: list[Send] = []
    with session_scope(settings.db_url) as s:
        # States are per kind: a store job 'verified' is waiting, a restore job 'verified' is working.
        active = or_(*(and_(Job.kind == kind, Job.state.in_(sorted(names))) for kind, names in states.ACTIVE.items()))
        for job in s.scalars(select(Job).where(active, Job.lease_until < t)):
            job.lease_until = t + timedelta(seconds=settings.lease_seconds)
            sends.extend(resume(s, job))
            log.warning("job %d (%s %s): lease expired, re-driving", job.id, job.kind, job.state)
    return sends


def resume(session, job: Job) -> list[Send]:  # noqa: ANN001
    """The messages that continue ``job`` from its current state."""
    if job.kind == "restore":
        return [Send("restore", (job.id,))]
    if job.state == S.DETECTED:
        return [Send("shard", (job.id,))]
    if job.state == S.REPLICATED:
        return [Send("verify", (job.id,))]
    if job.state == S.SHARDED:
        pending = session.scalars(
            select(Replica.id).join(Shard).join(CheckpointFile)
            .where(CheckpointFile.checkpoint_id == job.checkpoint_id, Replica.state.in_(("pending", "stored")))
        ).all()
        return [Send("replicate", (rid,)) for rid in pending]
    return []


def rotation_sweep(settings: Settings) -> list[Send]:
    with session_scope(settings.db_url) as s:
        runs = s.scalars(select(Checkpoint.run).where(Checkpoint.local_present.is_(True)).distinct()).all()
    return [Send("rotate_run", (run,)) for run in runs]


class Scheduler:
    def __init__(self, settings: Settings, send: Callable[[list[Send]], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.send, self.clock = settings, send, clock
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.stopping = threading.Event()
        self.leader = False
        self._last_sweep = float("-inf")

    def tick(self) -> None:
        ttl = max(10.0, self.settings.tick_seconds * 5)
        leader = acquire_lock(self.settings, LEADER, self.holder, ttl)
        if leader != self.leader:
            log.info("scheduler %s is %s", self.holder, "the leader" if leader else "standing by")
            self.leader = leader
        if not leader:
            return
        probe_all(self.settings)
        self.send(expired_work(self.settings))
        if self.clock() - self._last_sweep >= self.settings.tick_seconds * 10:
            self._last_sweep = self.clock()
            self.send(rotation_sweep(self.settings))

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("scheduler tick failed; retrying")
            self.stopping.wait(self.settings.tick_seconds)
        if self.leader:
            release_lock(self.settings, LEADER, self.holder)
