"""The fault harness: a real cluster with failpoints, the invariants it must keep, the table.

Every process of a :class:`FaultCluster` runs with ``CKPT_FAILPOINTS`` (pipeline.failpoints):
the Dramatiq worker, the scheduler and the watcher share one directory, each storage worker
has its own, so a test can break one worker and not the others. After each fault the
harness waits until the cluster is quiet again and checks, from the disks and not from what
the database believes:

- no data lost: every shard of every kept checkpoint (not superseded, vanished or forgotten)
  has a copy somewhere that hashes to its name, or the checkpoint's local file is still there
  and whole;
- no unsafe deletion: a checkpoint whose local copy is gone has RF such copies of every shard
  on distinct workers;
- no torn file: every file under a worker's ``shards/`` hashes to its name;
- ``PRAGMA integrity_check`` is ok.
"""
from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker
from sqlalchemy import select

from bench.chaos.trainer import sha256_of
from pipeline import states
from pipeline.cluster.client import free_port
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Job, JobEvent, Shard
from pipeline.db.models import StorageWorker as WorkerRow
from pipeline.integrity.scrub import request_scrub
from pipeline.restoring.job import request as restore_request
from pipeline.service.supervisor import STABLE_SECONDS
from pipeline.states import JobKind
from pipeline.store.rotation import rotation_candidates
from tests.checkpoints import atomic_save, state_dict
from tests.faults.proxy import Proxy
from tests.processes import Cluster, StorageWorker, base_env, wait_for

S = states.StoreState

#: Settings of a fault cluster: short leases, so a killed step is re-driven in seconds.
FAULT_ENV = {
    "CKPT_LEASE_SECONDS": "1",
    "CKPT_KEEP_LAST": "1",
    "CKPT_TICK_SECONDS": "0.2",
    "CKPT_SETTLE_SECONDS": "0.1",
    "CKPT_MIN_BACKOFF_MS": "100",
    "CKPT_MAX_BACKOFF_MS": "1000",
}


@dataclass
class Row:
    fault: str
    trials: int = 0
    lost: int = 0
    unsafe: int = 0
    torn: int = 0
    integrity_ok: bool = True
    recover_s: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, verdict: Verdict, recover: float, outcome: str) -> None:
        self.trials += 1
        self.lost += verdict.lost
        self.unsafe += verdict.unsafe
        self.torn += verdict.torn
        self.integrity_ok &= verdict.integrity == "ok"
        self.recover_s.append(recover)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.problems.extend(verdict.problems)

    @property
    def ok(self) -> bool:
        return self.trials > 0 and not (self.lost or self.unsafe or self.torn or self.problems) and self.integrity_ok


class Table:
    """The rows of this test session; printed at its end and saved as JSON."""

    rows: list[Row] = []

    @classmethod
    def row(cls, fault: str) -> Row:
        r = Row(fault)
        cls.rows.append(r)
        return r

    @classmethod
    def render(cls) -> str:
        head = (f"{'fault':<58} {'trials':>6} {'lost':>5} {'unsafe':>6} {'torn':>5} {'integ':>5} {'recover s':>16}"
                "  outcome")
        lines = [head, "-" * len(head)]
        for r in cls.rows:
            rec = (f"{sorted(r.recover_s)[len(r.recover_s) // 2]:.1f} (max {max(r.recover_s):.1f})"
                   if r.recover_s else "-")
            out = ", ".join(f"{k} {v}" if r.trials > 1 else k for k, v in sorted(r.outcomes.items()))
            lines.append(f"{r.fault[:58]:<58} {r.trials:>6} {r.lost:>5} {r.unsafe:>6} {r.torn:>5} "
                         f"{'ok' if r.integrity_ok else 'BAD':>5} {rec:>16}  {out}")
        return "\n".join(lines)

    @classmethod
    def save(cls, path: Path) -> None:
        path.write_text(json.dumps([r.__dict__ for r in cls.rows], indent=1, default=str))

    @classmethod
    def load(cls, path: Path) -> None:
        cls.rows = [Row(**doc) for doc in json.loads(path.read_text())]


@dataclass
class Verdict:
    lost: int = 0
    unsafe: int = 0
    torn: int = 0
    integrity: str = "ok"
    problems: list[str] = field(default_factory=list)


class FaultCluster(Cluster):
    def __init__(self, tmp: Path, *, env: dict[str, str] | None = None, proxy: bool = False,
                 worker_args: dict[int, tuple[str, ...]] | None = None, **kwargs) -> None:
        #: Extra ``ckpt worker`` arguments per worker index (e.g. a ``--capacity``).
        self.worker_args = worker_args or {}
        #: With ``proxy``, the cluster reaches the first storage worker through a
        #: :class:`~tests.faults.proxy.Proxy` that can corrupt or cut what it carries.
        self.proxy: Proxy | None = None
        self.use_proxy = proxy
        self.points = tmp / "failpoints"
        self.points.mkdir(parents=True, exist_ok=True)
        super().__init__(tmp, env={**FAULT_ENV, "CKPT_FAILPOINTS": str(self.points), **(env or {})},
                         **{"processes": 1, **kwargs})
        self.step = 0
        self._broker: RedisBroker | None = None
        self.expecting: list[Path] = []  # checkpoints written and not yet seen detected
        self.run = self.runs / "run"
        self.run.mkdir(exist_ok=True)

    def start(self) -> FaultCluster:
        # The proxy relays to the first worker, which is told that it is reached there too
        # (`ckpt worker --url`): a worker proves itself only for URLs that reach it.
        proxy_port = free_port() if self.use_proxy else 0
        # Each storage worker gets its own failpoint directory.
        for i in range(self.n_workers):
            d = self.points / f"worker{i}"
            d.mkdir(exist_ok=True)
            args = self.worker_args.get(i, ())
            if i == 0 and proxy_port:
                args = (*args, "--url", f"http://127.0.0.1:{proxy_port}")
            w = StorageWorker(self.tmp / f"worker{i}", base_env(self.home, **{**self.extra_env,
                                                                            "CKPT_FAILPOINTS": str(d)}),
                              self.tmp / "logs" / f"worker{i}.log", args=args)
            self.workers.append(w.start())
        if self.use_proxy:
            self.proxy = Proxy(self.workers[0].port, proxy_port)
            self.workers[0].url = self.proxy.url
        self.n_workers, spare = 0, self.n_workers  # Cluster.start: no more workers to start
        try:
            super().start()
        finally:
            self.n_workers = spare
        return self

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.close()
        if self.proxy is not None:
            self.proxy.close()  # its open connections would hold up the worker's graceful stop
        super().stop()

    # -- failpoints --------------------------------------------------------------------

    def _dir(self, where: str | None) -> Path:
        return self.points / where if where else self.points

    def arm(self, name: str, action: str = "kill", where: str | None = None) -> None:
        d = self._dir(where)
        for stale in (d / f"{name}.fired", d / f"{name}.hits"):
            stale.unlink(missing_ok=True)
        tmp = d / f".{name}.tmp"
        tmp.write_text(action + "\n")
        os.rename(tmp, d / name)

    def disarm(self, name: str, where: str | None = None) -> None:
        (self._dir(where) / name).unlink(missing_ok=True)

    def fired(self, name: str, where: str | None = None) -> float | None:
        """When the failpoint fired (wall clock), or None."""
        try:
            text = (self._dir(where) / f"{name}.fired").read_text()
        except FileNotFoundError:
            return None
        return float(text.split(" at ")[1].split()[0]) if " at " in text else time.time()

    def hits(self, name: str, where: str | None = None) -> int:
        """How many times an ``always`` failpoint acted."""
        try:
            return len((self._dir(where) / f"{name}.hits").read_text().splitlines())
        except FileNotFoundError:
            return 0

    def trace(self, where: str | None = None) -> Trace:
        return Trace(self._dir(where))

    # -- workload ----------------------------------------------------------------------

    def new_checkpoint(self, layers: int = 2) -> Path:
        """The run's next step: ~0.5 MiB in a few 256 KiB shards."""
        self.step += 1
        self.expecting.append(self.run / f"step_{self.step}.safetensors")
        return atomic_save(state_dict(self.step, layers=layers, width=64), self.run / f"step_{self.step}.safetensors")

    def wait_stable(self) -> None:
        """Wait until every child of ``ckpt up`` has run long enough that another crash is
        restarted at once (pipeline.service.supervisor.STABLE_SECONDS), not after a back-off."""
        def stable() -> bool:
            restarted = (self.home / "up.json").stat().st_mtime  # rewritten at each restart
            return time.time() - restarted >= STABLE_SECONDS + 0.2
        wait_for(stable, 10, "ckpt up's children to run stably", interval=0.1)

    def send(self, actor: str, *args: object) -> None:
        """Enqueue a message as the CLI would (without paying for a CLI process per trial)."""
        if self._broker is None:
            self._broker = RedisBroker(url=f"unix://{self.settings.redis_socket}")
        self._broker.enqueue(Message(queue_name="ckpt", actor_name=actor, args=args, kwargs={}, options={}))

    def scrub_now(self) -> list[int]:
        """`ckpt scrub`: one scrub job per live storage worker."""
        with session_scope(self.settings.db_url) as s:
            ids = [j.id for j in request_scrub(s, self.settings, reason="fault test")]
        for job_id in ids:
            self.send("scrub", job_id)
        return ids

    def restore(self, src: Path, dest: Path, timeout: float = 90) -> Job:
        """`ckpt restore SRC --to DEST --wait`: the job once it ended."""
        with session_scope(self.settings.db_url) as s:
            job_id = restore_request(s, self.settings, str(src), str(dest)).id
        self.send("restore", job_id)
        return wait_for(lambda: (j := self.job(job_id)).state in ("done", "failed") and j, timeout,
                        f"restore job {job_id}")

    def restart_dead_workers(self) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is not None:
                w.start()
                self._remember_pids()

    def quiet(self, timeout: float = 90) -> None:
        """Wait until every storage worker is up, no job is active, every store job is verified
        or final, and rotation has run (every checkpoint the local policy wants gone is rotated,
        or blocked)."""
        def settled() -> bool:
            with session_scope(self.settings.db_url) as s:
                if any(self.runs.rglob(".ckpt-trash-*")):
                    return False  # a crashed rotation's trash: put back or emptied by the next sweep
                if any(w.state not in ("up", "full") for w in s.scalars(select(WorkerRow))):
                    return False  # a worker taken for down (killed, stopped) is not back yet
                known = set(s.scalars(select(Checkpoint.path)))
                self.expecting = [p for p in self.expecting if str(p.resolve()) not in known]
                if self.expecting:
                    return False
                jobs = s.scalars(select(Job)).all()
                active = [j for j in jobs if j.state in states.ACTIVE[j.kind]]
                if active:
                    return False
                ckpts = s.scalars(select(Checkpoint).where(Checkpoint.local_present.is_(True))).all()
                # What the local policy wants gone (the newest save of a run by any measure stays:
                # pipeline.core.retention.newest_ids).
                wanted_gone = {cid for run in {c.run for c in ckpts}
                               for cid in rotation_candidates(s, run, self.settings.keep_last, self.settings.host_id)}
                latest = {}
                for j in jobs:
                    if j.kind == "store" and j.id > latest.get(j.checkpoint_id, (0, None))[0]:
                        latest[j.checkpoint_id] = (j.id, j)
                for c in ckpts:
                    job = latest.get(c.id, (0, None))[1]
                    if job is None:
                        return False
                    if job.state == S.VERIFIED and c.id in wanted_gone and not job.blocked_reason:
                        return False  # rotation not done yet
                return True

        wait_for(settled, timeout, "the cluster to settle", interval=0.2)

    # -- invariants --------------------------------------------------------------------

    def check(self) -> Verdict:
        v = Verdict()
        good: dict[str, set[str]] = {}  # sha -> worker ids holding a copy that hashes to it
        for w in self.workers:
            shards = w.data / "shards"
            if not shards.exists():
                continue
            for p in shards.rglob("*"):
                if p.is_file():
                    if sha256_of(p) == p.name:
                        good.setdefault(p.name, set()).add(w.node_id)
                    else:
                        v.torn += 1
                        v.problems.append(f"{p} does not hash to its name")
        with session_scope(self.settings.db_url) as s:
            for c in s.scalars(select(Checkpoint)):
                if c.released_at is not None:
                    continue  # superseded (a newer checkpoint holds its bytes), vanished or forgotten: not kept
                for f in s.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == c.id)):
                    local = Path(c.path) / f.relpath if f.relpath else Path(c.path)
                    local_whole = local.is_file() and sha256_of(local) == f.sha256
                    for sh in s.scalars(select(Shard).where(Shard.file_id == f.id)):
                        n = len(good.get(sh.sha256, ()))
                        if not local_whole and n == 0:
                            v.lost += 1
                            v.problems.append(f"checkpoint {c.id} shard {sh.seq}: no copy anywhere")
                        elif not local.exists() and n < self.settings.rf:
                            v.unsafe += 1
                            v.problems.append(f"checkpoint {c.id} deleted with {n}/{self.settings.rf} copies"
                                              f" of shard {sh.seq}")
        for p in self.runs.rglob(".ckpt-trash-*"):
            v.problems.append(f"{p} left in the trash")
        db = self.settings.db_url.split("///", 1)[1]
        with sqlite3.connect(db, timeout=30) as conn:
            v.integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        if v.integrity != "ok":
            v.problems.append(f"integrity_check: {v.integrity}")
        return v

    def outcome(self, since_job: int) -> str:
        """The end states of the jobs created since ``since_job`` (e.g. 'store rotated')."""
        with session_scope(self.settings.db_url) as s:
            jobs = s.scalars(select(Job).where(Job.id > since_job).order_by(Job.id)).all()
            parts = sorted({f"{j.kind} {j.state}" + (f" ({j.last_error[:40]})" if j.state == "failed" else "")
                            for j in jobs})
        return "; ".join(parts) or "no new job"

    def detected(self, path: Path) -> int | None:
        """The store job of the checkpoint at ``path`` once it is recorded."""
        with session_scope(self.settings.db_url) as s:
            return s.scalar(select(Job.id).join(Checkpoint, Job.checkpoint_id == Checkpoint.id)
                            .where(Checkpoint.path == str(path.resolve()), Job.kind == "store")
                            .order_by(Job.id.desc()).limit(1))

    def recorded(self, path: Path, sha256: str) -> bool:
        """Whether a version of the checkpoint at ``path`` holds a file of these bytes."""
        with session_scope(self.settings.db_url) as s:
            return s.scalar(select(CheckpointFile.id).join(Checkpoint, CheckpointFile.checkpoint_id == Checkpoint.id)
                            .where(Checkpoint.path == str(path.resolve()), CheckpointFile.sha256 == sha256)
                            .limit(1)) is not None

    def notes_containing(self, text: str) -> list[str]:
        """Timeline entries (job events) whose detail contains ``text``."""
        with session_scope(self.settings.db_url) as s:
            return list(s.scalars(select(JobEvent.detail).where(JobEvent.detail.contains(text))))

    def last_job_id(self) -> int:
        with session_scope(self.settings.db_url) as s:
            return s.scalar(select(Job.id).order_by(Job.id.desc()).limit(1)) or 0


class Trace:
    """The failpoints reached while the ``with`` block ran (names, in first-reached order)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "trace"
        self.names: list[str] = []
        self.where: dict[str, str] = {}  # name -> module:line of its first hit

    def __enter__(self) -> Trace:
        self.path.write_text("")
        return self

    def __exit__(self, *exc) -> None:
        text = self.path.read_text()
        self.path.unlink()
        for line in text.splitlines():
            name, _pid, where = line.split()
            if name not in self.names:
                self.names.append(name)
                self.where[name] = where

    def distinct(self, names: list[str]) -> list[str]:
        """``names`` less those at a place in the code already listed (``.before`` and
        ``.after`` count apart): the commits of a loop's later rounds are the same boundary."""
        seen, out = set(), []
        for n in names:
            key = (self.where.get(n), n.rsplit(".", 1)[-1])
            if key not in seen:
                seen.add(key)
                out.append(n)
        return out

    def places(self, names: list[str]) -> list[str]:
        """The distinct commit points of ``names`` armed by their place in the code
        (``gc@gc.py:212.before``): a later message that finds less work reaches the commit
        after a loop at a smaller ordinal, but at the same place."""
        out = []
        for n in self.distinct(names):
            if m := re.match(r"^(\w+)\.commit\d+\.(before|after)$", n):
                n = f"{m.group(1)}@{self.where[n]}.{m.group(2)}"
            out.append(n)
        return out


def store_until(cluster: FaultCluster, reached: Callable[[], object], what: str, tries: int = 8) -> None:
    """Write new checkpoints until ``reached()``: placement decides which workers a store
    uses, so a fault armed on one worker is hit by some store, not necessarily the first.
    Each store is waited for (its job ends, or the fault is reached) before the next."""
    for _ in range(tries):
        path = cluster.new_checkpoint()

        def done() -> bool:
            if reached():
                return True
            job = cluster.detected(path)
            return job is not None and cluster.job(job).state not in states.ACTIVE[JobKind.STORE]

        wait_for(done, 60, f"{path.name} to be stored or {what}")
        if reached():
            return
    raise AssertionError(f"{tries} checkpoints stored and never {what}")


def check_rows(*rows: Row) -> None:
    """Fail with what went wrong in any of ``rows``."""
    bad = [f"{r.fault}: {r.problems[:3]} outcomes {r.outcomes}" for r in rows if not r.ok]
    assert not bad




def trial(cluster: FaultCluster, row: Row, fire, name: str | None, where: str | None = None,
          timeout: float = 30) -> None:
    """Run ``fire()`` (which starts the work the fault hits), wait for the failpoint ``name``
    to fire and the cluster to settle, check the invariants and add the trial to ``row``."""
    cluster.wait_stable()
    before = cluster.last_job_id()
    start = time.time()
    fire()
    if name is not None:
        wait_for(lambda: cluster.fired(name, where), timeout, f"failpoint {name} to fire")
        fired = cluster.fired(name, where)
    else:
        fired = start
    cluster.restart_dead_workers()
    cluster.quiet()
    recover = time.time() - fired
    row.add(cluster.check(), recover, cluster.outcome(before))
