"""The world of the model-based lifecycle test: real files, the real control plane, real storage
workers, every step run in this process, and a model of what the trainer and the user did.

A :class:`World` is one example: a fresh root (watched runs, a restore directory, a sentinel
directory outside the restore roots), a fresh SQLite control plane built by the migrations, and
the storage worker processes the test module started (they keep what earlier examples stored;
every example's tensors are its own, so nothing is shared). Messages the steps send are
collected in :attr:`World.pending`, not sent to Dramatiq: the caller chooses their order, delivers
one twice or drops one (Redis is disposable transport; the scheduler's re-drive is the
guarantee). Each method is one thing that happens, and appends a readable line to
:attr:`World.history`; the regression tests (test_regressions.py) call them in order.

:meth:`World.check` asserts the invariants of issue 27 after every step:

(a) nothing is deleted (or changed) locally without RF good copies (verified in the control
    plane and whole on the worker's disk) of exactly that content, unless the user forgot it
    (``ckpt forget`` or a remote policy they set);
(b) the newest complete save of every run has its local copy or RF good copies (copies the
    test itself damaged are not held against the system, as long as one good copy is left);
(c) a restore of a path gives back exactly a complete version that was there, and the one on
    disk now when that one is complete and was looked at, or refuses with an error; and never
    a file that differs from the one at the path when it was asked for (a re-save killed
    halfway over a protected folder: refused, not the older version; a file gone from the path
    is not held against it) (checked by :meth:`World.restore`);
(d) nothing outside the restore roots is written or removed, and a restore never replaces a
    run or a root;
(e) at the end of an example, once the system is quiet, every complete save still on disk as
    written is protected in that version, or named in a detection problem
    (:meth:`World.finish`);
(f) ``pipeline.api.latest(run)`` (what ``ckpt restore --latest`` gives) and the status run
    summary's newest protected checkpoint are the same: a current protected checkpoint, the
    newest protected by ``pipeline.core.retention.recency``; and when the run's newest complete
    save (by the model's clock) is protected, it is that save, not an older one with a higher
    step (unless their recorded completion times are equal: then the writer's step decides);
(g) the per-run counts by state kept as data (``run_state_counts``) equal a recount of the
    checkpoints.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from pipeline import operations, states
from pipeline import settings as settings_mod
from pipeline.api import latest
from pipeline.cluster.membership import probe_all
from pipeline.core.retention import recency
from pipeline.db import hosts
from pipeline.db.copies import good_copy
from pipeline.db.engine import dispose_all, session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    Content,
    ContentCopy,
    DetectionProblem,
    Job,
    Shard,
    StorageWorker,
)
from pipeline.db.transitions import now
from pipeline.detection.catalog import latest_store_job
from pipeline.detection.watcher import Watcher
from pipeline.errors import AttemptsExhausted, CkptError
from pipeline.service import scheduler
from pipeline.status import run_facts
from pipeline.steps import Send
from tests.counts import kept, recount
from tests.model.writers import Written, build
from tests.processes import KEY
from tests.processes import StorageWorker as WorkerProcess

RF = 2
RUNS = ("r0", "r1")
_nonces = itertools.count(1)


class Violation(AssertionError):
    """Raised when an invariant of the lifecycle does not hold."""


@dataclass
class Msg:
    actor: str
    args: tuple[Any, ...]
    retries: int = 0

    def __str__(self) -> str:
        return f"{self.actor}{self.args}" + (f" (retry {self.retries})" if self.retries else "")


@dataclass
class Save:
    """One save the trainer made (or is making) at ``path``."""

    id: int
    run: str
    path: Path
    kind: str
    sharded: bool
    written: Written
    slow: bool
    actions: list[tuple[str, int]]  # (half|rest|all, file index) still to do
    done: int = 0
    complete_at: int | None = None   # the model's clock when its last byte was in place
    version: dict[str, str] | None = None  # relpath -> SHA-256 of the whole entry when complete
    killed: bool = False
    destroyed: bool = False          # the trainer or the user removed or overwrote it
    destroyed_safe: bool = True      # ... while it had RF good copies
    scanned_after: bool = False      # the watcher looked at the path after it completed

    @property
    def label(self) -> str:
        return f"save {self.id} ({self.path.parent.name}/{self.path.name})"


@dataclass
class WorldStats:
    steps: int = 0
    messages: int = 0
    restores: int = 0
    removed_by_system: int = 0
    longest: int = 0


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


#: At most this many rounds of leaving the system alone at the end of an example (finish()).
QUIET_ROUNDS = 12


class World:
    def __init__(self, base: Path, workers: list[WorkerProcess], *, keep_last: int = 2) -> None:
        self.base, self.workers = base, workers
        self.nonce = next(_nonces) * 1_000_003 + os.getpid()
        self.home, self.runs_root = base / "home", base / "runs"
        self.restore_dir, self.outside = base / "restore", base / "outside"
        for d in (self.home, self.runs_root, self.restore_dir, self.outside):
            d.mkdir(parents=True)
        for run in RUNS:
            (self.runs_root / run).mkdir()
        (self.outside / "keep.txt").write_text("nothing may touch this\n")
        (self.outside / "sub").mkdir()
        (self.outside / "sub" / "data.bin").write_bytes(os.urandom(1000))
        # A trap: a directory inside the restore roots that leads outside them.
        (self.restore_dir / "link").symlink_to(self.outside, target_is_directory=True)
        self.settings = settings_mod.load({
            "home": self.home, "roots": (str(self.runs_root / "*"),), "cluster_key": KEY,
            "redis_url": "stub://", "workers": tuple(w.url for w in workers), "rf": RF, "keep_last": keep_last,
            "shard_size": 32 * 1024, "settle_seconds": 0.0, "quiet_seconds": 3600.0, "lease_seconds": 60.0,
            "max_attempts": 8, "gc_grace_seconds": 0.0, "scrub_cron": "", "gc_cron": "", "mdns": 0,
            "restore_roots": (str(self.restore_dir), str(self.runs_root)), "host": "model-host",
            "wire_compression": "off", "scrub_rate": 0, "gc_rate": 0.0, "worker_down_seconds": 3600.0,
        }, environ={})
        upgrade(self.settings.db_url)
        settings_mod.configure(self.settings)
        self.pending: list[Msg] = []
        self.history: list[str] = []
        self.stats = WorldStats()
        self.clock = 0
        self.saves: list[Save] = []
        self.expect: dict[Path, str] = {}        # file -> SHA-256 the trainer left there
        self.seen: dict[Path, tuple[int, int, int]] = {}  # file -> (inode, size, mtime) last checked
        self.blobs: dict[str, bytes] = {}
        self.steps: dict[str, int] = {r: 0 for r in RUNS}
        self.run_deleted_at: dict[str, int] = {}
        self.run_inodes = {r: (self.runs_root / r).stat().st_ino for r in RUNS}
        self.user_forgot: set[int] = set()
        self.policy_runs: set[str] = set()
        self.damaged: set[tuple[str, str]] = set()   # (worker node id, shard sha) the test damaged
        self.violations: list[str] = []
        self._rehash: dict[tuple[str, int, int], str | None] = {}
        self._outside = self._snapshot()
        # Imported once the settings name the stub broker: importing pipeline.tasks installs one.
        from pipeline.tasks import actors

        self.actors = actors
        self._saved_send = actors.send_all
        actors.send_all = self._collect
        self.watcher = Watcher(self.settings, self._collect, use_events=False)
        self.watcher.reconcile()
        probe_all(self.settings)

    # -- plumbing --------------------------------------------------------------------

    def close(self) -> None:
        self.actors.send_all = self._saved_send
        self._quiesce()
        dispose_all()
        shutil.rmtree(self.base, ignore_errors=True)

    def _collect(self, sends: list[Send]) -> None:
        self.pending.extend(Msg(s.actor, tuple(s.args)) for s in sends)

    def _note(self, line: str) -> None:
        self.history.append(line)
        self.stats.steps += 1
        self.clock += 1

    def _quiesce(self) -> None:
        """Wait for the helper threads a step left running (the re-hash of shared copies a
        scan starts): each step of the model sees the effects of the previous one whole."""
        for t in threading.enumerate():
            if t is not threading.current_thread() and t.name.startswith("ckpt-early"):
                t.join(timeout=60)

    def _set(self, **changes: Any) -> None:
        self.settings = dataclasses.replace(self.settings, **changes)
        settings_mod.configure(self.settings)
        self.watcher.settings = self.settings

    def run_dir(self, run: str) -> Path:
        return self.runs_root / run

    # -- the trainer -----------------------------------------------------------------

    def save(self, run: str, kind: str, *, slow: bool = False, sharded: bool = False,
             step: int | None = None) -> Save:
        """The trainer starts a save of ``kind``; atomic (in place at once) unless ``slow``."""
        if step is None:
            self.steps[run] += 1
            step = self.steps[run]
        w = build(kind, self.nonce, RUNS.index(run), step, sharded=sharded)
        return self._start(run, kind, sharded, w, slow,
                           f"save({run!r}, {kind!r}, step={step}, slow={slow}, sharded={sharded})")

    def resave(self, save: Save, *, slow: bool = False, sharded: bool | None = None) -> Save:
        """The trainer saves again at the same path (a restart after a crash, Lightning's
        ``last.ckpt``, ``save_pretrained`` into the same folder): new content."""
        self.steps[save.run] += 1
        sharded = save.sharded if sharded is None else sharded
        w = build(save.kind, self.nonce + 7 * self.steps[save.run], RUNS.index(save.run), self.steps[save.run],
                  sharded=sharded)
        w = dataclasses.replace(w, name=save.written.name)
        return self._start(save.run, save.kind, sharded, w, slow,
                           f"resave({save.label}, slow={slow}, sharded={sharded})")

    def _start(self, run: str, kind: str, sharded: bool, w: Written, slow: bool, line: str) -> Save:
        self._note(line)
        (self.run_dir(run)).mkdir(exist_ok=True)
        if run not in self.run_inodes:
            self.run_inodes[run] = self.run_dir(run).stat().st_ino
        path = self.run_dir(run) / w.name
        for other in self.saves:
            if other.path == path and other.complete_at is None and not other.killed:
                other.killed = True  # a new save at its path: the old writer is gone
        actions: list[tuple[str, int]] = []
        for i, (_rel, data) in enumerate(w.files):
            actions += [("half", i), ("rest", i)] if slow and len(data) > 1 else [("all", i)]
        s = Save(len(self.saves), run, path, kind, sharded, w, slow, actions)
        self.saves.append(s)
        for _rel, data in w.files:
            self.blobs[sha(data)] = data
        if slow:
            self.progress(s, note=False)
        else:
            self._atomic(s)
        return s

    def _atomic(self, s: Save) -> None:
        w = s.written
        if not w.is_dir:
            tmp = s.path.parent / f".{w.name}.tmp-model"
            tmp.write_bytes(w.files[0][1])
            self._destroying([s.path])
            os.replace(tmp, s.path)
        elif not s.path.exists():
            tmp = s.path.parent / f".{w.name}.tmp-model"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for rel, data in w.files:
                (tmp / rel).write_bytes(data)
            os.rename(tmp, s.path)
        else:  # save_pretrained into a folder that is there: file by file, each renamed into place
            self._destroying([s.path / r for r in w.removes] + [s.path / r for r, _ in w.files])
            for rel in w.removes:
                (s.path / rel).unlink(missing_ok=True)
            for rel, data in w.files:
                tmp = s.path / f".{rel}.tmp-model"
                tmp.write_bytes(data)
                os.replace(tmp, s.path / rel)
        s.actions, s.done = [], len(w.files)
        self._completed(s)

    def progress(self, s: Save, *, note: bool = True) -> None:
        """A slow writer writes the next half of a file (or a whole small one)."""
        if note:
            self._note(f"progress({s.label})")
        if not s.actions or s.killed:
            return
        what, i = s.actions.pop(0)
        rel, data = s.written.files[i]
        target = s.path / rel if s.written.is_dir else s.path
        if s.written.is_dir:
            if s.done == 0 and s.path.is_dir():  # the writer's own cleanup of a re-save
                self._destroying([s.path / r for r in s.written.removes])
                for r in s.written.removes:
                    (s.path / r).unlink(missing_ok=True)
            s.path.mkdir(exist_ok=True)
        if what in ("half", "all"):
            self._destroying([target])
            target.write_bytes(data[: len(data) // 2] if what == "half" else data)
        else:
            with open(target, "ab") as f:
                f.write(data[len(data) // 2:])
        self.expect[target] = sha(target.read_bytes())
        self._seen(target)
        if what != "half":
            s.done += 1
        if not s.actions:
            self._completed(s)

    def lightning_epoch(self, run: str, improved: bool) -> Save:
        """Lightning's ``ModelCheckpoint(save_top_k=k, save_last=True)`` at the end of an epoch:
        ``epoch=..-step=N.ckpt`` when the metric improved, then ``last.ckpt`` (no step in its
        name) rewritten in place with the same step."""
        self.steps[run] += 1
        step = self.steps[run]
        if improved:
            self.save(run, "lightning", step=step)
        return self.save(run, "lightning_last", step=step)

    def protected(self, s: Save) -> bool:
        """Whether the version ``s`` wrote is recorded and protected."""
        with session_scope(self.settings.db_url, readonly=True) as session:
            for c in session.scalars(select(Checkpoint).where(Checkpoint.path == str(s.path))):
                job = latest_store_job(session, c.id)
                if job is not None and job.state in states.PROTECTED and \
                        {f.relpath: f.sha256 for f in c.files} == s.version:
                    return True
        return False

    def kill(self, s: Save) -> None:
        """The trainer dies in the middle of a slow save: what it wrote stays."""
        self._note(f"kill({s.label})")
        s.killed = True

    def _completed(self, s: Save) -> None:
        s.complete_at = self.clock
        files = ([p for p in sorted(s.path.rglob("*")) if p.is_file()] if s.written.is_dir else [s.path])
        s.version = {}
        for p in files:
            data = p.read_bytes()
            self.blobs[sha(data)] = data
            s.version[str(p.relative_to(s.path)) if s.written.is_dir else ""] = sha(data)
            self.expect[p] = sha(data)
            self._seen(p)

    def _seen(self, p: Path) -> None:
        st = p.stat()
        self.seen[p] = (st.st_ino, st.st_size, st.st_mtime_ns)

    def _destroying(self, files: list[Path]) -> None:
        """The trainer or the user is about to overwrite or remove ``files``: the saves whose
        complete content they are lose it now (safely only if it had RF good copies then)."""
        hit = {f for f in files if f in self.expect}
        for s in self.saves:
            if s.version is None or s.destroyed:
                continue
            mine = {(s.path / r if s.written.is_dir else s.path) for r in s.version}
            if hit & mine and all(self.expect.get(f) == s.version[_rel(s, f)] for f in hit & mine):
                s.destroyed = True
                s.destroyed_safe = all(self.copies(x, strict=True) >= RF for x in s.version.values())
        for f in hit:
            self.expect.pop(f, None)
            self.seen.pop(f, None)

    def trainer_delete(self, s: Save) -> None:
        """The trainer removes one of its old checkpoints (save_total_limit, save_top_k)."""
        self._note(f"trainer_delete({s.label})")
        self._remove_entry(s.path)

    def user_delete_run(self, run: str) -> None:
        self._note(f"user_delete_run({run!r})")
        self._remove_entry(self.run_dir(run))
        self.run_deleted_at[run] = self.clock
        for s in self.saves:
            if s.run == run and s.complete_at is None:
                s.killed = True
        self.run_inodes.pop(run, None)

    def _remove_entry(self, path: Path) -> None:
        if not os.path.lexists(path):
            return
        self._destroying([f for f in self.expect if f == path or path in f.parents])
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()

    # -- the user --------------------------------------------------------------------

    def _ref(self, s: Save) -> str:
        return str(s.path)

    def pin(self, s: Save) -> str:
        self._note(f"pin({s.label})")
        try:
            operations.pin(self.settings, self._ref(s), "model test")
            return "pinned"
        except CkptError as exc:
            return f"refused: {exc}"

    def forget(self, s: Save) -> str:
        self._note(f"forget({s.label})")
        try:
            for v in operations.forget(self.settings, [self._ref(s)]):
                self.user_forgot.add(v.checkpoint_id)
            return "forgotten"
        except CkptError as exc:
            return f"refused: {exc}"

    def protect(self, s: Save) -> str:
        """``pipeline.protect(path)``: the trainer declares the save complete."""
        self._note(f"protect({s.label})")
        try:
            operations.store(self.settings, str(s.path), detail="declared complete by the model test")
            return "recorded"
        except CkptError as exc:
            return f"refused: {exc}"
        finally:
            self._quiesce()

    def set_keep_last(self, k: int) -> None:
        self._note(f"set_keep_last({k})")
        self._set(keep_last=k)

    def set_remote_keep_last(self, run: str, k: int) -> None:
        self._note(f"set_remote_keep_last({run!r}, {k})")
        opts = json.loads(self.settings.run_options or "{}")
        if k:
            opts[str(self.run_dir(run).resolve())] = {"keep_last": k}
            self.policy_runs.add(run)
        else:
            opts.pop(str(self.run_dir(run).resolve()), None)
        self._set(run_options=json.dumps(opts) if opts else "")

    # -- the system ------------------------------------------------------------------

    def scan(self) -> None:
        self._note("scan()")
        self.watcher.scan()
        self._quiesce()
        for s in self.saves:
            if s.complete_at is not None:
                s.scanned_after = True

    def restart_watcher(self) -> None:
        self._note("restart_watcher()")
        self.watcher = Watcher(self.settings, self._collect, use_events=False)
        self.watcher.reconcile()

    def deliver(self, i: int, *, keep: bool = False, note: bool = True) -> None:
        """Run pending message ``i`` (modulo the queue's length); ``keep``: a duplicate delivery."""
        if not self.pending:
            return
        msg = self.pending[i % len(self.pending)] if keep else self.pending.pop(i % len(self.pending))
        if note:
            self._note(f"{'deliver_duplicate' if keep else 'deliver'}({msg})")
        self.stats.messages += 1
        try:
            getattr(self.actors, msg.actor).fn(*msg.args)
        except Exception as exc:  # what Dramatiq's Retries and our JobFailures middleware do
            final = isinstance(exc, AttemptsExhausted) or msg.retries >= self.settings.max_retries
            from pipeline.tasks.failures import record_failure  # after the broker (conftest.process_broker)

            record_failure(self.settings, msg.actor, msg.args, exc, final=final)
            self.history.append(f"    {msg.actor} raised {type(exc).__name__}: {exc}"[:300])
            if not final:
                self.pending.append(Msg(msg.actor, msg.args, msg.retries + 1))
        finally:
            self._quiesce()

    def drop(self, i: int) -> None:
        """Redis loses a message (the scheduler's re-drive must recover the work)."""
        if self.pending:
            msg = self.pending.pop(i % len(self.pending))
            self._note(f"drop({msg})")

    def drain(self, limit: int = 400) -> None:
        """Every pending message delivered in order, follow-ups too (workers keeping up)."""
        self._note("drain()")
        n = 0
        while self.pending and n < limit:
            self.deliver(0, note=False)
            n += 1
            self.check(deletions_only=True)

    def expire_leases(self) -> None:
        """Time passes: every active job's lease ends and the scheduler re-drives it."""
        self._note("expire_leases()")
        with session_scope(self.settings.db_url) as s:
            s.execute(update(Job).where(Job.lease_until.is_not(None))
                      .values(lease_until=now() - timedelta(seconds=1)))
        self._collect(scheduler.expired_work(self.settings))
        self._collect(scheduler.retry_waiting(self.settings))

    def rotation(self) -> None:
        self._note("rotation_sweep()")
        self._collect(scheduler.rotation_sweep(self.settings))

    def retention(self) -> None:
        self._note("retention_sweep()")
        scheduler.retention_sweep(self.settings)

    def repair_sweep(self) -> None:
        self._note("repair_sweep()")
        self._collect(scheduler.under_replicated(self.settings))

    def gc(self) -> None:
        self._note("gc()")
        operations.collect_garbage(self.settings)

    def scrub(self) -> None:
        self._note("scrub()")
        operations.scrub_now(self.settings)

    def probe(self) -> None:
        self._note("probe()")
        result = probe_all(self.settings)
        self._collect(scheduler.reconcile_returned(self.settings, result.returned))

    def tick(self) -> None:
        """The scheduler's periodic sweep: rotation, the remote policy, repair of short
        contents, stores waiting for room."""
        self._note("tick()")
        self._collect(scheduler.rotation_sweep(self.settings))
        scheduler.retention_sweep(self.settings)
        self._collect(scheduler.under_replicated(self.settings))
        self._collect(scheduler.retry_waiting(self.settings))

    def settle(self) -> None:
        """A quiet while: the watcher scans, every message runs, the scheduler sweeps, and again."""
        self.scan()
        self.drain()
        self.tick()
        self.drain()

    def finish(self) -> None:
        """The end of an example: the system is left alone until it is quiet (leases end, the
        scheduler re-drives), then (e) every complete save that is on disk as it was saved is
        protected in its current version, or named in a detection problem."""
        # Until nothing moves any more (each round ends leases, so the scheduler re-drives what
        # a dropped message or a damaged copy left behind), two rounds in a row; a system that
        # is still moving after QUIET_ROUNDS is reported below like a wedged one.
        still, before = 0, None
        for _ in range(QUIET_ROUNDS):
            self.probe()  # the membership probes a real cluster runs: a worker taken for down comes back
            self.scan()
            self.drain()
            self.expire_leases()
            self.drain()
            self.tick()
            self.drain()
            self.check()
            with session_scope(self.settings.db_url, readonly=True) as s:
                now_ = sorted(tuple(r) for r in s.execute(select(Job.id, Job.state, Job.attempts)))
            still = still + 1 if now_ == before else 0
            before = now_
            if still >= 2:
                break
        with session_scope(self.settings.db_url, readonly=True) as s:
            problems = {p.path: p.reason for p in s.scalars(select(DetectionProblem))}
            for save in self.saves:
                if save.version is None or save.destroyed or not self._on_disk(save):
                    continue
                latest = max((o for o in self.saves if o.path == save.path and o.version is not None),
                             key=lambda o: o.complete_at or 0)
                if latest is not save or str(save.path) in problems:
                    continue
                ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == str(save.path),
                                                         Checkpoint.current.is_(True)))
                files = {f.relpath: f.sha256 for f in ckpt.files} if ckpt is not None else {}
                job = latest_store_job(s, ckpt.id) if ckpt is not None else None
                state = job.state if job is not None else "not recorded"
                if files != save.version:
                    self._violate(f"(e) {save.label} is complete on disk, but its current recorded version is "
                                  f"{_short(files)} ({state}), not {_short(save.version)}, and no problem names it")
                if state not in states.PROTECTED and state != states.StoreState.FORGOTTEN:
                    self._violate(f"(e) {save.label} is complete on disk and recorded, but {state} once the system "
                                  f"was quiet: {job.last_error if job else ''} {job.blocked_reason if job else ''}")

    def _on_disk(self, s: Save) -> bool:
        return all(self.expect.get(s.path / r if r else s.path) == x for r, x in (s.version or {}).items())

    # -- faults on the storage workers ----------------------------------------------

    def stored_copies(self) -> list[tuple[WorkerProcess, str]]:
        """(worker, shard SHA-256) of every content of this example a worker holds on disk."""
        with session_scope(self.settings.db_url, readonly=True) as s:
            shas = sorted(s.scalars(select(Content.sha256)))
        return [(w, x) for x in shas for w in self.workers if w.shard(x).exists()]

    def damage(self, i: int, how: str) -> str:
        """A worker loses (``lose``) or corrupts (``truncate``) one copy on its disk. At most one
        damaged copy per content at a time, and never its last whole one (RF 2 tolerates one)."""
        candidates = []
        for w, x in self.stored_copies():
            others = [o for o in self.workers if o is not w and self._disk_good(o, x)]
            if others and not any((o.node_id, x) in self.damaged for o in self.workers) and self._disk_good(w, x):
                candidates.append((w, x))
        if not candidates:
            return "nothing to damage"
        w, x = candidates[i % len(candidates)]
        self._note(f"damage({w.node_id}, {x[:12]}, {how!r})")
        p = w.shard(x)
        if how == "lose":
            p.unlink()
        else:
            data = p.read_bytes()
            p.write_bytes(data[:-1])
        self.damaged.add((w.node_id, x))
        return "damaged"

    def _disk_good(self, w: WorkerProcess, x: str) -> bool:
        p = w.shard(x)
        try:
            st = p.stat()
        except FileNotFoundError:
            return False
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in self._rehash:
            self._rehash[key] = _file_sha(p)
        return self._rehash[key] == x

    def copies(self, file_sha: str, *, strict: bool) -> int:
        """Good copies of the file content ``file_sha``: the fewest of any of its shards.

        A copy is good when the control plane counts it (verified after stored, its content
        live) and the worker's file hashes to its name. Not ``strict``: a copy this test
        damaged itself still counts, while one whole copy of the shard is left."""
        with session_scope(self.settings.db_url, readonly=True) as s:
            shards = set(s.scalars(select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.sha256 == file_sha)))
            if not shards:
                return 0
            counted = set(s.execute(
                select(ContentCopy.sha256, StorageWorker.id)
                .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
                .join(Content, Content.sha256 == ContentCopy.sha256)
                .where(ContentCopy.sha256.in_(shards), good_copy())).all())
        fewest = None
        for x in shards:
            good = sum(1 for w in self.workers if (x, w.node_id) in counted and self._disk_good(w, x))
            n = good if strict or good == 0 else good + sum(
                1 for w in self.workers if (w.node_id, x) in self.damaged and not self._disk_good(w, x))
            fewest = n if fewest is None else min(fewest, n)
        return fewest or 0

    # -- restore ---------------------------------------------------------------------

    def restore(self, s: Save, where: str, *, overwrite: bool) -> str:
        """``ckpt restore PATH --to DEST [--overwrite]`` of the path of ``s``; runs the restore
        step at once and checks invariant (c) on what it gave back."""
        self._note(f"restore({s.label}, to={where!r}, overwrite={overwrite})")
        self.stats.restores += 1
        dest = {"fresh": self.restore_dir / f"out-{self.clock}",
                "existing": self.restore_dir / "existing",
                "in_place": s.path,
                "run": s.path.parent,
                "through_link": self.restore_dir / "link" / f"out-{self.clock}"}[where]
        if where == "existing":
            dest.mkdir(exist_ok=True)
            (dest / "old.txt").write_text("an older restore\n")
        there = _tree(s.path) if os.path.lexists(s.path) else {}  # the files at the path when asked
        run_there = os.path.lexists(s.path.parent)  # a run the user deleted is no run to replace
        with session_scope(self.settings.db_url) as session:  # this world delivers the host's messages
            hosts.report_in(session, self.settings.host_id, self.settings.host_label, consumer=True)
        try:
            r = operations.restore_to(self.settings, str(s.path), str(dest), overwrite=overwrite)
        except CkptError as exc:
            self.history.append(f"    refused: {exc}"[:300])
            return "refused"
        finally:
            self._cleanup_existing(where)
        for _ in range(self.settings.max_retries + 2):
            msgs = [m for m in self.pending if m.actor == "restore" and m.args[0] == r.job_id]
            if not msgs:
                break
            self.deliver(self.pending.index(msgs[0]), note=False)
        with session_scope(self.settings.db_url, readonly=True) as session:
            job = session.get(Job, r.job_id)
            state, error = job.state, job.last_error
        if state != states.RestoreState.DONE:
            self.history.append(f"    restore job {r.job_id} {state}: {error}"[:300])
            if not error:
                self._violate(f"(c) restore of {s.path} ended {state} without saying why")
            self._cleanup_existing(where)
            return str(state)
        got = _tree(Path(r.detail))
        if where == "run" and run_there:
            self._violate(f"(d) restore --overwrite replaced the run directory {dest}")
        self._check_restored(s.path, got)
        newer = sorted(r for r, x in there.items() if got.get(r) != x)
        if newer:
            self._violate(f"(c) restore of {s.path} gave back {_short(got)}, but the files at the path when it was "
                          f"asked were {_short(there)} ({', '.join(r or '<file>' for r in newer)} differ): it "
                          f"should have refused")
        if where in ("fresh", "existing", "through_link"):
            _remove(Path(r.detail))
        self._cleanup_existing(where)
        return "done"

    def _cleanup_existing(self, where: str) -> None:
        if where == "existing":
            _remove(self.restore_dir / "existing")

    def _check_restored(self, path: Path, got: dict[str, str]) -> None:
        versions = [v.version for v in self.saves if v.path == path and v.version is not None]
        if got not in versions:
            self._violate(f"(c) restore of {path} gave back {_short(got)}, which was never a complete version "
                          f"there (complete versions: {[_short(v) for v in versions]})")
            return
        latest = max((v for v in self.saves if v.path == path and v.version is not None),
                     key=lambda v: v.complete_at or 0)
        on_disk = all(self.expect.get(path / r if r else path) == x for r, x in (latest.version or {}).items())
        if on_disk and latest.scanned_after and got != latest.version:
            self._violate(f"(c) restore of {path} silently gave back an older version {_short(got)}; the complete "
                          f"version on disk (looked at by the watcher) is {_short(latest.version or {})}")

    # -- invariants ------------------------------------------------------------------

    def _violate(self, what: str) -> None:
        self.violations.append(what)
        self.history.append(f"    VIOLATION {what}")
        raise Violation(what + "\nhistory:\n  " + "\n  ".join(self.history[-60:]))

    def check(self, *, deletions_only: bool = False) -> None:
        self._check_deletions()
        if deletions_only:
            return
        self._check_newest()
        self._check_latest()
        self._check_outside()
        self._check_counts()
        self.stats.longest = max(self.stats.longest, len(self.history))

    def _check_counts(self) -> None:
        """(g): what the overview and /metrics count is what a recount finds."""
        with session_scope(self.settings.db_url, readonly=True) as s:
            counted, held = recount(s), kept(s)
        if counted != held:
            self._violate(f"run_state_counts {held} differ from a recount {counted}")

    def _check_deletions(self) -> None:
        """(a): every file the trainer left that is gone or changed now was removed by the
        system; it must have had RF good copies of exactly its content."""
        for f, want in list(self.expect.items()):
            try:
                st = os.stat(f)
                now_ = (st.st_ino, st.st_size, st.st_mtime_ns)
            except (FileNotFoundError, NotADirectoryError):
                now_ = None
            if now_ is not None and self.seen.get(f) == now_:
                continue
            got = _file_sha(f) if now_ is not None else None
            if got == want:
                self.seen[f] = now_  # type: ignore[assignment]
                continue
            if got is None:
                self.expect.pop(f)
                self.seen.pop(f, None)
            else:
                self.expect[f], self.seen[f] = got, now_  # type: ignore[assignment]
            self.stats.removed_by_system += 1
            if self._forgotten_by_user(f, want):
                continue
            n = self.copies(want, strict=True)
            if n < RF:
                what = "removed" if got is None else "overwritten"
                self._violate(f"(a) {f} ({want[:12]}) was {what} by the system with {n} good copies of its "
                              f"content (RF {RF})")

    def _forgotten_by_user(self, f: Path, want: str) -> bool:
        with session_scope(self.settings.db_url, readonly=True) as s:
            for c in s.scalars(select(Checkpoint).join(CheckpointFile).where(CheckpointFile.sha256 == want)):
                job = latest_store_job(s, c.id)
                run = Path(c.run).name
                if job is not None and job.state == states.StoreState.FORGOTTEN and (
                        c.id in self.user_forgot or run in self.policy_runs):
                    return True
        return False

    def _check_newest(self) -> None:
        """(b): the newest complete save of every run is on disk or has RF good copies."""
        for run in RUNS:
            done = [s for s in self.saves if s.run == run and s.complete_at is not None
                    and s.complete_at > self.run_deleted_at.get(run, -1)]
            if not done:
                continue
            newest = max(done, key=lambda s: s.complete_at or 0)
            if newest.destroyed and not newest.destroyed_safe:
                continue  # the trainer overwrote or removed it before it was protected
            for rel, x in (newest.version or {}).items():
                f = newest.path / rel if rel else newest.path
                if self.expect.get(f) == x:
                    continue
                n = self.copies(x, strict=False)
                if n < RF:
                    self._violate(f"(b) the newest complete save of {run}, {newest.label}, has neither its local "
                                  f"file {rel or newest.path.name} nor {RF} good copies of it ({n})")
            # (d) a run is never replaced by the system
            if run in self.run_inodes and not self._same_run_dir(run):
                self._violate(f"(d) the run directory {self.run_dir(run)} was removed or replaced")

    def _check_latest(self) -> None:
        """(f): latest(), the status summary and the newest complete save agree."""
        paths = {run: str(self.run_dir(run).resolve()) for run in RUNS}
        with session_scope(self.settings.db_url, readonly=True) as s:
            state: dict[int, tuple[Checkpoint, str]] = {}  # the last store job of each decides its state
            for c, job_state in s.execute(select(Checkpoint, Job.state).join(Job, Job.checkpoint_id == Checkpoint.id)
                                          .where(Checkpoint.current.is_(True), Job.kind == "store",
                                                 Checkpoint.run.in_(list(paths.values()))).order_by(Job.id)):
                state[c.id] = (c, job_state)
            facts = run_facts(s, list(paths.values()))
            for run, run_path in paths.items():
                protected = [c for c, st_ in state.values() if c.run == run_path and st_ in states.PROTECTED]
                summary = facts.get(run_path, {}).get("protected")
                summary_id = summary.id if summary is not None else None
                best = max(protected, key=lambda c: recency(c.mtime, c.step, c.id)) if protected else None
                best_id = best.id if best is not None else None
                got = latest(run_path, settings=self.settings) if best_id != summary_id or best_id else None
                got_id = got.id if got is not None else None
                if got_id != best_id or summary_id != best_id:
                    self._violate(f"(f) the newest protected checkpoint of {run} is {best_id}, but latest() gives "
                                  f"{got_id} and the status summary {summary_id}")
                done = [v for v in self.saves if v.run == run and v.version is not None
                        and (v.complete_at or 0) > self.run_deleted_at.get(run, -1)]
                if best is None or not done:
                    continue
                newest = max(done, key=lambda v: v.complete_at or 0)
                mine = [c for c in protected if c.path == str(newest.path)
                        and {f.relpath: f.sha256 for f in c.files} == newest.version]
                if mine and best.id != mine[0].id and best.mtime != mine[0].mtime:
                    self._violate(f"(f) the newest complete save of {run}, {newest.label}, is protected (checkpoint "
                                  f"{mine[0].id}, step {mine[0].step}), but latest() gives checkpoint {best.id} "
                                  f"({best.name}, step {best.step})")

    def _same_run_dir(self, run: str) -> bool:
        try:
            st = os.lstat(self.run_dir(run))
        except FileNotFoundError:
            return False
        return st.st_ino == self.run_inodes.get(run) and not os.path.islink(self.run_dir(run))

    def _snapshot(self) -> dict[str, str]:
        """Everything under the example's directory outside the restore roots and the home."""
        out = {}
        skip = {self.home, self.runs_root, self.restore_dir}
        for dirpath, dirs, names in os.walk(self.base):
            d = Path(dirpath)
            dirs[:] = [x for x in dirs if d / x not in skip]
            for name in names + [x for x in dirs if (d / x).is_symlink()]:
                p = d / name
                out[str(p.relative_to(self.base))] = (f"-> {os.readlink(p)}" if p.is_symlink()
                                                     else _file_sha(p) or "?")
            for x in dirs:
                out[str((d / x).relative_to(self.base)) + "/"] = "dir"
        return out

    def _check_outside(self) -> None:
        """(d): nothing outside the restore roots was written or removed."""
        now_ = self._snapshot()
        if now_ != self._outside:
            added = sorted(set(now_) - set(self._outside))
            gone = sorted(set(self._outside) - set(now_))
            changed = sorted(k for k in set(now_) & set(self._outside) if now_[k] != self._outside[k])
            self._violate(f"(d) outside the restore roots: added {added}, removed {gone}, changed {changed}")


def _rel(s: Save, f: Path) -> str:
    return str(f.relative_to(s.path)) if s.written.is_dir else ""


def _tree(path: Path) -> dict[str, str]:
    if path.is_file():
        return {"": _file_sha(path) or "?"}
    return {str(p.relative_to(path)): _file_sha(p) or "?" for p in sorted(path.rglob("*")) if p.is_file()}


def _short(v: dict[str, str]) -> str:
    return "{" + ", ".join(f"{r or '<file>'}: {x[:8]}" for r, x in sorted(v.items())) + "}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()
