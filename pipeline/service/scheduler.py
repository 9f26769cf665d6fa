"""The scheduler: one leader-locked loop that keeps the pipeline moving.

Every tick it renews its leader lease, challenges the storage workers (reconciling those
that came back), and re-drives every job whose lease expired (a killed Dramatiq worker or
a wiped Redis delays work, never loses it: docs/design.md, invariant 3). Every sweep it also
applies rotation, repairs under-replicated shards (a worker is down or draining), marks
drained workers removable, and starts the nightly scrub when it is due.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, tzinfo
from typing import TypeVar

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pipeline import alerts, capacity, consumers, states
from pipeline.cluster.discovery import Browser
from pipeline.cluster.membership import ProbeResult, probe_all
from pipeline.cron import last_fire
from pipeline.db import workers
from pipeline.db.content_rf import run_rf
from pipeline.db.copies import (
    contents_of,
    good_copies_per_shard,
    just,
    move,
    place,
    shas_of,
    short_contents,
    short_without,
)
from pipeline.db.engine import optimize, rowcount, session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    CheckpointPart,
    Content,
    ContentCopy,
    Job,
    Lock,
    Shard,
    StorageWorker,
)
from pipeline.db.transitions import latest_store_ids, now, transition
from pipeline.errors import PlacementError
from pipeline.integrity.gc import mark, request_gc, send_for
from pipeline.integrity.reconcile import request_reconcile
from pipeline.integrity.repair import repair_damaged, request_repair
from pipeline.integrity.retention import apply_policy, compact_history
from pipeline.integrity.scrub import request_scrub
from pipeline.objectstore import tier
from pipeline.objectstore.tier import is_target
from pipeline.service.readiness import mark_ready
from pipeline.settings import Settings
from pipeline.states import ContentState, CopyState, JobKind, Tier, WorkerState
from pipeline.steps import Send
from pipeline.store.replication import on_its_way
from pipeline.webhook import Notifier

T = TypeVar("T")
log = logging.getLogger("ckpt.scheduler")
S, R = states.StoreState, states.RestoreState
LEADER = "scheduler"
#: The row of the locks table that holds the last scheduled collection's fire time.
GC_MARKER = "gc:last-fire"


def holder_is_dead(holder: str) -> bool:
    """Whether ``holder`` (``host:pid``) is a process of this host that no longer runs.

    A scheduler restarted by ``ckpt up`` takes over at once instead of waiting out the
    lease of the one that crashed. Another host's holder is never presumed dead.
    """
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def acquire_lock(settings: Settings, name: str, holder: str, ttl: float) -> bool:
    """Take or renew the named lease; True while ``holder`` has it."""
    t = now()
    with session_scope(settings.db_url) as s:
        current = s.scalar(select(Lock.holder).where(Lock.name == name))
        # An expiry further ahead than any lease this lock grants was written by a fast clock.
        takeable = (Lock.holder == holder) | (Lock.expires_at < t) | (Lock.expires_at > t + timedelta(seconds=2 * ttl))
        if current is not None and holder_is_dead(current):
            takeable = takeable | (Lock.holder == current)
        took = rowcount(s.execute(
            update(Lock).where(Lock.name == name, takeable)
            .values(holder=holder, expires_at=t + timedelta(seconds=ttl))
        ))
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
    """Renew the lease of every active job whose lease expired, or whose host came back
    while it waited for it; the messages that resume them.

    Sending them is safe whatever else is in flight: a step whose message is still queued
    gets no second one, and none goes to a host that is down (pipeline/tasks/sending.py).
    """
    t = now()
    sends: list[Send] = []
    with session_scope(settings.db_url) as s:
        # States are per kind: a store job 'verified' is waiting, a restore job 'verified' is working.
        active = or_(*(and_(Job.kind == kind, Job.state.in_(sorted(names))) for kind, names in states.ACTIVE.items()))
        # No lease is ever granted for longer than lease_seconds: one that ends further
        # ahead was written by a process whose clock runs fast, and would block the job.
        too_far = t + timedelta(seconds=2 * settings.lease_seconds)
        live = consumers.live(s, settings)
        back = Job.waiting_for.in_(live)
        for job in s.scalars(select(Job).where(active, (Job.lease_until < t) | (Job.lease_until > too_far) | back)):
            expired = job.lease_until is None or job.lease_until < t
            why = ("expired" if expired else f"{job.waiting_for} has a consumer again" if job.waiting_for
                   else "ends too far ahead (a fast clock wrote it)")
            if job.waiting_for in live:  # its host is back: sending marks it again if it went away
                job.waiting_for = None
                job.blocked_reason = None if consumers.is_waiting(job.blocked_reason) else job.blocked_reason
            job.lease_until = t + timedelta(seconds=settings.lease_seconds)
            sends.extend(resume(s, settings, job))
            log.warning("job %d (%s %s): lease %s, re-driving", job.id, job.kind, job.state, why)
    return sends


#: The actor that runs each job kind (store jobs are resumed step by step).
ACTOR = {JobKind.RESTORE: "restore", JobKind.SCRUB: "scrub", JobKind.REPAIR: "repair",
         JobKind.RECONCILE: "reconcile", JobKind.GC: "gc"}


def resume(session: Session, settings: Settings, job: Job) -> list[Send]:
    """The messages that continue ``job`` from its current state."""
    if job.kind in ACTOR:
        return [Send(ACTOR[JobKind(job.kind)], (job.id,))]
    if job.state == S.DETECTED:
        return [Send("shard", (job.id,))]
    if job.state == S.REPLICATED:
        return [Send("verify", (job.id,))]
    if job.state == S.SHARDED:
        sends: list[Send] = []
        run = session.scalar(select(Checkpoint.run).where(Checkpoint.id == job.checkpoint_id))
        rf = settings.rf_for(run) if run is not None else settings.rf  # the RF of its checkpoint's run
        # Copies placed on a worker that went down meanwhile no longer count: place others.
        for content in contents_of(session, job.checkpoint_id or 0):
            for cp in content.copies:
                if cp.state == CopyState.PENDING and cp.worker.state not in states.PLACEABLE_WORKERS:
                    move(session, cp, CopyState.ABANDONED, error=f"{cp.worker_id} is {cp.worker.state}")
            if content.state == ContentState.LIVE:
                try:
                    place(session, content, rf)
                except PlacementError as exc:
                    log.warning("job %d: content %s cannot be placed again yet: %s", job.id, content.sha256[:12], exc)
                    sends += repair_damaged(session, settings, just(content.sha256),
                                            f"store {job.id} cannot place its copies while this copy is damaged")
        shas = shas_of(job.checkpoint_id or 0)
        pending = session.scalars(select(ContentCopy.id).where(ContentCopy.sha256.in_(shas),
                                                               ContentCopy.state == CopyState.PENDING)).all()
        if pending:
            return sends + [Send("replicate", (cid,)) for cid in pending]
        # Nothing left to send (a crash came between the last upload and its fan-in): a
        # replicate message of any sent copy runs the fan-in again.
        any_copy = session.scalar(select(ContentCopy.id).where(ContentCopy.sha256.in_(shas)).limit(1))
        return sends + ([Send("replicate", (any_copy,))] if any_copy is not None else [])
    return []


def retry_waiting(settings: Settings) -> list[Send]:
    """Stores waiting for room (or for their content's collection) try placement again, each
    once its wait (a lease) is over."""
    sends = []
    with session_scope(settings.db_url) as s:
        for job in s.scalars(select(Job).where(Job.kind == JobKind.STORE, Job.state == S.WAITING,
                                               (Job.lease_until.is_(None)) | (Job.lease_until < now()))):
            transition(s, job.id, JobKind.STORE, S.WAITING, S.DETECTED, lease_seconds=settings.lease_seconds,
                       detail="trying placement again")
            sends.append(Send("shard", (job.id,)))
    return sends


def rotation_sweep(settings: Settings) -> list[Send]:
    with session_scope(settings.db_url) as s:
        runs = set(s.scalars(select(Checkpoint.run).where(Checkpoint.local_present.is_(True)).distinct()))
        runs |= set(s.scalars(select(CheckpointPart.run).where(  # parts left of rotated checkpoints
            CheckpointPart.local_present.is_(True), CheckpointPart.checkpoint_id.is_not(None)).distinct()))
    return [Send("rotate_run", (run,)) for run in sorted(runs)]


def nightly_scrub(settings: Settings, at: datetime, timezone: tzinfo | None = None) -> list[Send]:
    """Scrub jobs for the latest nightly fire time, once per day whatever fires how often.

    Each job's dedupe key is ``nightly:<date>:<worker>``: a double fire, two schedulers or
    a catch-up after downtime all collapse into one scrub per worker and day. A fire time
    that came before anything was protected has nothing to scrub and is skipped.
    """
    if not settings.scrub_cron:
        return []
    fire = last_fire(settings.scrub_cron, at, timezone)
    if fire is None:
        return []
    with session_scope(settings.db_url) as s:
        first = s.scalar(select(func.min(Checkpoint.detected_at)))
        if first is None or first > fire:
            return []
        jobs = request_scrub(s, settings, dedupe=f"nightly:{fire.date().isoformat()}",
                             reason=f"nightly, due {fire.isoformat(timespec='minutes')}")
        return [Send("scrub", (j.id,)) for j in jobs]


def reconcile_returned(settings: Settings, worker_ids: list[str]) -> list[Send]:
    """A reconcile job for each worker that came back."""
    sends = []
    with session_scope(settings.db_url) as s:
        for worker_id in worker_ids:
            job = request_reconcile(s, settings, worker_id, "it came back")
            if job is not None:
                sends.append(Send("reconcile", (job.id,)))
    return sends


def scheduled_gc(settings: Settings, at: datetime, timezone: tzinfo | None = None) -> list[Send]:
    """The scheduled garbage collection, once per fire time (like the nightly scrub)."""
    if not settings.gc_cron:
        return []
    fire = last_fire(settings.gc_cron, at, timezone)
    if fire is None:
        return []
    due = fire.isoformat(timespec="minutes")
    with session_scope(settings.db_url) as s:
        # The fire time handled last, in a row of the locks table: one mark per fire time,
        # whatever the restarts (only the leader runs this).
        done = s.get(Lock, GC_MARKER)
        if done is not None and done.holder >= due:
            return []
        if done is None:
            s.add(Lock(name=GC_MARKER, holder=due, expires_at=fire))
        else:
            done.holder, done.expires_at = due, fire
    mark(settings)
    with session_scope(settings.db_url) as s:
        return send_for(request_gc(s, settings, dedupe=f"gc:{due}", reason=f"scheduled, due {due}"))


def retention_sweep(settings: Settings) -> None:
    """Forget what each run's remote policy drops; compact old history of forgotten ones."""
    with session_scope(settings.db_url) as s:
        apply_policy(s, settings)
    with session_scope(settings.db_url) as s:
        compact_history(s, settings)


def under_replicated(settings: Settings) -> list[Send]:
    """Repair jobs for the contents of protected checkpoints that are short of RF good copies
    (rebuilt from a worker's copy, a local file, or an object store's copy), for the damaged
    copies of stores still on their way (they hold its placement back), and for damaged copies
    on object stores (placement never reuses their row: only a repair puts them again)."""
    sends = []
    with session_scope(settings.db_url) as s:
        for sha in short_contents(s, run_rf(s, settings)):
            job = request_repair(s, settings, sha, "under-replicated: a worker is down, draining or lost its copy")
            if job is not None:
                sends.append(Send("repair", (job.id,)))
        damaged = select(ContentCopy.sha256).where(ContentCopy.state.in_(sorted(states.DAMAGED)))
        sends += repair_damaged(s, settings, damaged, "its copy on an object store is damaged", tier=Tier.OBJECT_STORE)
        in_flight = select(Job.checkpoint_id).where(
            Job.id.in_(latest_store_ids()), Job.state.in_(sorted(states.ACTIVE[JobKind.STORE] | {S.WAITING})))
        shas = select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id.in_(in_flight))
        sends += repair_damaged(s, settings, shas,
                                "a store on its way cannot place a copy where this one is damaged")
    return sends


#: Contents a sweep places or sends to object stores at most (the next sweep goes on).
STORE_SWEEP_LIMIT = 500


def store_sweep(settings: Settings) -> list[Send]:
    """The copies the object-store policy still owes: for the checkpoints on their way or
    protected whose run wants ``target_copies``, each content short of them on object stores is
    placed there (a store that could not take it when the checkpoint was sharded, a copy found
    bad), and every such copy still pending is sent (again: one a store throttled or could not
    take waits pending with its error). A store job that requires them fans in as they land."""
    sends: list[Send] = []
    t = now()
    with session_scope(settings.db_url) as s:
        owed = select(Job.checkpoint_id).where(
            Job.id.in_(latest_store_ids()),
            Job.state.in_(sorted(states.PROTECTED | {S.SHARDED.value, S.REPLICATED.value})))
        runs = set(s.scalars(select(Checkpoint.run).where(Checkpoint.id.in_(owed)).distinct()))
        for run in sorted(runs):
            wanted = settings.target_policy(run)[0]
            if not wanted:
                continue
            per_shard = good_copies_per_shard(
                CheckpointFile.checkpoint_id.in_(owed.where(Job.checkpoint_id.in_(
                    select(Checkpoint.id).where(Checkpoint.run == run)))), tier=Tier.OBJECT_STORE)
            short = select(per_shard.c.sid).where(per_shard.c.n < wanted)
            shas = list(s.scalars(select(Shard.sha256).where(Shard.id.in_(short)).distinct()
                                  .limit(STORE_SWEEP_LIMIT - len(sends))))
            for content in s.scalars(select(Content).where(Content.sha256.in_(shas),
                                                           Content.state == ContentState.LIVE)):
                try:
                    with s.begin_nested():
                        place(s, content, wanted, tier=Tier.OBJECT_STORE)
                except PlacementError:
                    pass  # no store takes it now: the next sweep tries again
                if on_its_way(content):
                    continue  # its first verified worker copies send these, for a worker to put
                for cp in content.copies:
                    quiet = cp.sent_at is None or t - cp.sent_at > timedelta(seconds=settings.lease_seconds)
                    if cp.state == CopyState.PENDING and is_target(cp.worker_id) and quiet:
                        sends.append(Send("replicate", (cp.id,)))
            if len(sends) >= STORE_SWEEP_LIMIT:
                break
    return sends


def finish_drains(settings: Settings) -> None:
    """A draining worker becomes removable once none of its shards still needs its copy."""
    with session_scope(settings.db_url) as s:
        for w in s.scalars(select(StorageWorker).where(StorageWorker.state == WorkerState.DRAINING)):
            total, short, _size = short_without(s, w.id, run_rf(s, settings))
            if not short:
                workers.set_state(s, w, WorkerState.REMOVABLE, error=None)
                log.info("storage worker %s is drained: %d shards have RF copies elsewhere; it can be removed",
                         w.id, total)


def dead_letter_summary(settings: Settings) -> tuple[int, datetime | None] | None:
    """(count, oldest failure) of the dead letters; None when the broker cannot say."""
    try:
        from pipeline.tasks import deadletters

        return deadletters.summary(settings)
    except Exception:
        log.warning("alerts: could not read the dead letters", exc_info=True)
        return None


class Scheduler:
    def __init__(self, settings: Settings, send: Callable[[list[Send]], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.send, self.clock = settings, send, clock
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.stopping = threading.Event()
        self.leader: bool | None = None  # unknown until the first tick, which logs it
        self._last_sweep = float("-inf")
        self._last_optimize = float("-inf")  # at start, then every optimize_hours
        self._ready = False
        #: The alert webhook's sender (its own thread: a dead endpoint never slows a tick).
        self.notifier = Notifier(settings.alert_webhook, settings.key()) if settings.alert_webhook else None

    def tick(self) -> None:
        ttl = max(10.0, self.settings.tick_seconds * 5)
        leader = acquire_lock(self.settings, LEADER, self.holder, ttl)
        if leader != self.leader:
            log.info("scheduler %s is %s", self.holder, "the leader" if leader else "standing by")
            self.leader = leader
        if not leader:
            return
        settings = self.settings
        probe = self._part("probing the storage workers", lambda: probe_all(settings)) or ProbeResult()
        # The probe may have taken as long as the lease (CKPT_PROBE_SECONDS and a moment per
        # exchange): renewed before anything is acted on, or, taken by another scheduler
        # meanwhile, nothing is (that one's tick does it).
        if not acquire_lock(settings, LEADER, self.holder, ttl):
            log.warning("scheduler %s lost the lead while probing the storage workers; standing by", self.holder)
            self.leader = False
            return
        if settings.object_targets():
            self._part("probing the object stores", lambda: tier.probe(settings))
        self._part("reconciling returned workers", lambda: self.send(reconcile_returned(settings, probe.returned)))
        self._part("re-driving expired work", lambda: self.send(expired_work(settings)))
        if probe.went_down or self.clock() - self._last_sweep >= settings.tick_seconds * 10:
            self._last_sweep = self.clock()

            def sample() -> None:
                with session_scope(settings.db_url) as s:
                    capacity.sample(s, settings)

            self._part("the rotation sweep", lambda: self.send(rotation_sweep(settings)))
            self._part("the retention sweep", lambda: retention_sweep(settings))
            self._part("sampling capacity", sample)
            self._part("repairing under-replicated content", lambda: self.send(under_replicated(settings)))
            self._part("copies owed to object stores", lambda: self.send(store_sweep(settings)))
            self._part("retrying waiting stores", lambda: self.send(retry_waiting(settings)))
            self._part("finishing drains", lambda: finish_drains(settings))
            self._part("the nightly scrub", lambda: self.send(nightly_scrub(settings, now())))
            self._part("the scheduled collection", lambda: self.send(scheduled_gc(settings, now())))
            self._part("evaluating alerts", self.evaluate_alerts)
        hours = settings.optimize_hours
        if hours > 0 and self.clock() - self._last_optimize >= hours * 3600:
            self._last_optimize = self.clock()
            self._part("optimizing the database", lambda: optimize(settings.db_url))

    def evaluate_alerts(self) -> None:
        """Bring the alerts up to date (pipeline/alerts.py); the webhook is told of each change."""
        for event in alerts.refresh(self.settings, dead_letters=dead_letter_summary(self.settings)):
            if self.notifier is not None:
                self.notifier.post(event)

    def _part(self, what: str, work: Callable[[], T]) -> T | None:
        """Run one part of a tick: a failure in one (a peer's bad answer, a bad row) is logged
        and never keeps the tick's other parts from running."""
        try:
            return work()
        except Exception:
            log.exception("scheduler: %s failed this tick; the rest of the tick goes on", what)
            return None

    def run(self) -> None:
        browser = None
        if self.settings.mdns:
            try:
                browser = Browser(self.settings)
            except OSError as exc:  # no usable interface: the static list still works
                log.warning("mDNS discovery disabled: %s", exc)
        try:
            while not self.stopping.is_set():
                try:
                    self.tick()
                except Exception:
                    log.exception("scheduler tick failed; retrying")
                else:
                    if not self._ready:
                        mark_ready(self.settings, "scheduler")
                        self._ready = True
                self.stopping.wait(self.settings.tick_seconds)
        finally:
            if browser is not None:
                browser.close()
            if self.notifier is not None:
                self.notifier.close(wait=2.0)
            if self.leader:
                release_lock(self.settings, LEADER, self.holder)
