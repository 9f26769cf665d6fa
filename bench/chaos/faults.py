"""The chaos soak's faults: a seeded schedule, and how each fault is made and healed.

Kinds (issue 28): a host partitioned (its port on the bridge down), a storage worker stalled
(SIGSTOP), a process SIGKILLed (Redis, the Dramatiq master or one of its workers, the scheduler,
the watcher, ``ckpt up`` itself, a storage worker, a training host's Dramatiq or watcher), the
control plane restarted (SIGTERM to ``ckpt up``, then started again), a worker's disk full (a
ballast file fills its own ext4 disk), one link shaped to a crawl (tbf at 300 kbit; netem is
not available), a stranger answering garbage on a worker's port (the worker stopped, an SSH
banner in its place), a training host down (its trainer, Dramatiq and watcher killed, its link
down) for 5 minutes; the object store partitioned (a blackhole: its host's link down, so
connections and requests in flight time out; or refused: its front stopped, its port closed) or
throttled (its front answers 503 SlowDown to every request).
"""
from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass, field
from datetime import datetime

from bench.chaos.box import NORMAL_RATE, PY, STORAGE, STORE, TRAINERS, ChaosBox, pid_alive
from bench.chaos.checks import consumed_since, stores_in_flight, workers_not_up
from bench.system import descendants

CRAWL_RATE = 300e3
KINDS = ("partition", "stall", "kill", "control-restart", "disk-full", "crawl", "stranger", "trainer-down",
         "store-partition", "store-throttle")
#: Seconds each kind lasts at scale 1 (drawn uniformly); kills last no time (the box restarts them).
DURATIONS = {"partition": (30, 120), "stall": (30, 300), "kill": (0, 0), "control-restart": (0, 0),
             "disk-full": (30, 180), "crawl": (30, 180), "stranger": (30, 120), "trainer-down": (300, 300),
             "store-partition": (60, 300), "store-throttle": (60, 300)}
KILLABLE = ("control:redis", "control:dramatiq", "control:dramatiq-worker", "control:scheduler", "control:watcher",
            "control:up", *(f"{w}:worker" for w in STORAGE), *(f"{t}:{r}" for t in TRAINERS
                                                                 for r in ("dramatiq", "watcher")))


@dataclass
class Fault:
    kind: str
    target: str  # a host, or host:process for a kill
    start: float  # seconds into the soak
    duration: float
    injected_at: float | None = None  # monotonic
    healed_at: float | None = None  # when it was undone (the kill itself for a kill)
    healed_utc: datetime | None = None  # the same, on the wall clock the control plane writes
    recovered_at: float | None = None  # when the target was healthy again
    #: Stores in flight when it was healed (job id -> checkpoint host): healed means these moved on.
    pending: dict[int, str | None] = field(default_factory=dict)
    killed: int | None = None  # the PID a kill of one of ``ckpt up``'s processes hit
    notes: list[str] = field(default_factory=list)

    @property
    def host(self) -> str:
        return self.target.split(":")[0]

    @property
    def heal_seconds(self) -> float | None:
        if self.healed_at is None or self.recovered_at is None:
            return None
        return self.recovered_at - self.healed_at

    def unconsumes_host(self) -> bool:
        """Whether it leaves a training host's queue without a live consumer (a restore asked
        there meanwhile is refused, rightly) until the host's Dramatiq processes beat again: the
        host down, or its Dramatiq killed. Not a partition: it cuts the host off from the storage
        workers, not from the control plane (box.py), so its queue stays consumed and a restore
        asked there through the partition must come back."""
        return self.host in TRAINERS and (self.kind == "trainer-down" or self.target == f"{self.host}:dramatiq")

    def __str__(self) -> str:
        return f"{self.kind} {self.target} at {self.start:.0f}s for {self.duration:.0f}s"


def _targets(kind: str) -> list[str]:
    return {"partition": ["control", *TRAINERS, *STORAGE], "stall": list(STORAGE), "kill": list(KILLABLE),
            "control-restart": ["control"], "disk-full": list(STORAGE), "crawl": [*TRAINERS, *STORAGE],
            "stranger": list(STORAGE), "trainer-down": list(TRAINERS),
            "store-partition": [f"{STORE}:blackhole", f"{STORE}:refused"], "store-throttle": [STORE]}[kind]


def draw(seed: int, first: float, until: float, gap: tuple[float, float], scale: float,
         max_overlap: int = 2) -> list[Fault]:
    """The schedule: a fault every ``gap`` seconds from ``first`` to ``until``, each kind once
    (in a seeded order) before any repeats; never two at once on one host, never more than
    ``max_overlap`` at once, each over by ``until``."""
    rng = random.Random(seed)
    order = list(KINDS)
    rng.shuffle(order)
    out: list[Fault] = []
    t = first
    while t < until - 5:
        busy = [f for f in out if f.start <= t < f.start + max(f.duration, 10)]
        if len(busy) < max_overlap:
            kind = order.pop(0) if order else rng.choice(KINDS)
            free = [x for x in _targets(kind) if x.split(":")[0] not in {f.host for f in busy}]
            if free:
                lo, hi = DURATIONS[kind]
                duration = min(max(5.0, rng.uniform(lo, hi) * scale) if hi else 0.0, until - t)
                out.append(Fault(kind, rng.choice(free), t, duration))
            else:
                order.insert(0, kind)
        t += rng.uniform(*gap)
    return out


class Injector:
    """Makes and undoes faults on a :class:`ChaosBox`."""

    def __init__(self, box: ChaosBox) -> None:
        self.box = box

    def ready(self, f: Fault) -> bool:
        """Whether ``f`` can be made now: a fault on the control host waits until its control
        plane runs (a kill of the scheduler while ``ckpt up`` restarts has nothing to kill)."""
        return f.host != "control" or self.box.control_ready()

    def inject(self, f: Fault) -> None:
        box, h = self.box, f.host
        if f.kind == "partition":
            box.box.link(h, "down")
        elif f.kind == "stall":
            box.signal(box.procs[(h, "worker")], signal.SIGSTOP)
        elif f.kind == "kill":
            f.notes.append(self._kill(f))
        elif f.kind == "control-restart":
            up = box.procs[("control", "up")]
            up.held = True
            if up.popen is not None and up.popen.poll() is None:
                up.popen.send_signal(signal.SIGTERM)
        elif f.kind == "disk-full":
            ballast = box.disk(h) / "ballast"
            st = os.statvfs(box.disk(h))
            size = max(0, st.f_bavail * st.f_frsize - 64 * 1024)
            with open(ballast, "wb") as out:
                os.posix_fallocate(out.fileno(), 0, max(1, size))
            f.notes.append(f"ballast {size / 1e6:.0f} MB")
        elif f.kind == "crawl":
            box.box.reshape(h, CRAWL_RATE)
        elif f.kind == "stranger":
            box.stop(box.procs[(h, "worker")])
            box.add(h, "stranger", [PY, "-m", "bench.chaos.stranger", box.box.addr[h], "7070"]).held = False
        elif f.kind == "trainer-down":
            for role in ("trainer", "dramatiq", "watcher"):
                p = box.procs.get((h, role))
                if p is not None:
                    p.held = True
                    box.signal(p, signal.SIGKILL)
            box.box.link(h, "down")
        elif f.target == f"{STORE}:blackhole":
            box.box.link(h, "down")
        elif f.target == f"{STORE}:refused":
            box.stop(box.procs[(h, "front")])
        elif f.kind == "store-throttle":
            box.store_mode.write_text("throttle")
        else:
            raise ValueError(f"unknown fault {f}")

    def _kill(self, f: Fault) -> str:
        box = self.box
        host, what = f.target.split(":")
        if host == "control" and what not in ("up",):
            kids = box.control_children()
            pid = kids.get("dramatiq" if what == "dramatiq-worker" else what)
            if pid is None:
                return f"{what}: no such child of ckpt up"
            if what == "dramatiq-worker":
                below = descendants(pid)
                if not below:
                    return "the dramatiq master has no worker process"
                pid = below[0]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return f"pid {pid} gone already"
            f.killed = pid
            return f"SIGKILL pid {pid}"
        p = box.procs[(host, what)]
        pid = p.popen.pid if p.popen else None
        box.signal(p, signal.SIGKILL)
        return f"SIGKILL process group {pid}"

    def heal(self, f: Fault) -> bool:
        """Undo ``f``; False while it cannot be undone yet (try again later)."""
        box, h = self.box, f.host
        if f.kind == "partition" or f.target == f"{STORE}:blackhole":
            box.box.link(h, "up")
        elif f.target == f"{STORE}:refused":
            box.procs[(h, "front")].held = False  # the box starts it again
        elif f.kind == "store-throttle":
            box.store_mode.write_text("pass")
        elif f.kind == "stall":
            box.signal(box.procs[(h, "worker")], signal.SIGCONT)
        elif f.kind == "control-restart":
            up = box.procs[("control", "up")]
            if box.alive(up):
                return False  # still stopping its children; the box starts it again once it is gone
            up.held = False
        elif f.kind == "disk-full":
            (box.disk(h) / "ballast").unlink(missing_ok=True)
        elif f.kind == "crawl":
            box.box.reshape(h, NORMAL_RATE)
        elif f.kind == "stranger":
            box.stop(box.procs[(h, "stranger")])
            box.procs[(h, "worker")].held = False
        elif f.kind == "trainer-down":
            box.box.link(h, "up")
            stopped = (box.root / "stop-trainers").exists()
            for role in ("trainer", "dramatiq", "watcher"):
                p = box.procs.get((h, role))
                if p is not None and not (role == "trainer" and stopped):
                    p.held = False
        return True

    def healed(self, f: Fault) -> None:
        """Note what must move on for ``f`` to count as recovered: the stores in flight now (a
        training host's own; every host's for the control plane, a storage worker or the object store)."""
        flight = stores_in_flight(self.box.db_url)
        f.pending = {j: h for j, h in flight.items() if f.host not in TRAINERS or h == f.host}

    def recovered(self, f: Fault, faulted: set[str]) -> bool:
        """The fault's target works again: its processes run, its worker (or the object store) is
        ``up``, and every store that was in flight when it was healed has moved on (verified, or
        ended), except those of a training host that is itself under a fault now (``faulted``)."""
        box, h = self.box, f.host
        if h == "control":
            if not box.control_ready():
                return False
            if f.killed is not None:  # its replacement runs (a master's worker: it has one again)
                master = box.control_children().get("dramatiq")
                running = (set(box.control_children().values()) if f.target != "control:dramatiq-worker"
                           else {p for p in descendants(master) if pid_alive(p)} if master else set())
                if not running or f.killed in running:
                    return False
        else:
            procs = [p for (host, role), p in box.procs.items() if host == h and role != "stranger" and not p.held]
            if not all(box.alive(p) for p in procs):
                return False
            if h in STORAGE and h in workers_not_up(box.db_url, {h: box.urls[h]}):
                return False
            if h == STORE and workers_not_up(box.db_url, {h: box.bucket.url}):
                return False
            if f.unconsumes_host() and not consumed_since(box.db_url, h, f.healed_utc):
                return False  # its Dramatiq processes run but have not said they consume its queue yet
        if f.pending:
            flight = stores_in_flight(box.db_url)
            if any(j in flight and (host == h or host not in faulted) for j, host in f.pending.items()):
                return False
        return True
