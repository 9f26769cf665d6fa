"""Real processes for tests: storage workers and a whole ``ckpt up``, always cleaned up."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.system import cmdline
from pipeline import settings as settings_mod
from pipeline.cluster import auth
from pipeline.cluster.client import WorkerClient, free_port
from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.errors import WorkerError

KEY = "integration-test-key"
FAST = {  # settings that make a test cluster react in seconds, not minutes
    "CKPT_SETTLE_SECONDS": "0.3",
    "CKPT_QUIET_SECONDS": "3",
    "CKPT_SCAN_INTERVAL": "1",
    "CKPT_LEASE_SECONDS": "6",
    "CKPT_TICK_SECONDS": "0.5",
    "CKPT_POLL_MS": "100",
    "CKPT_WORKER_DOWN_SECONDS": "2",
    "CKPT_MIN_BACKOFF_MS": "200",
    "CKPT_MAX_BACKOFF_MS": "2000",
    "CKPT_SHARD_SIZE": str(256 * 1024),
    "CKPT_MAX_ATTEMPTS": "8",
    # No zeroconf outside a private network namespace (tests/integration/test_discovery.py).
    "CKPT_MDNS": "0",
    "CKPT_WEB_PORT": "0",  # a test that wants the web UI picks a free port
}


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def descendants(pid: int) -> list[int]:
    out = []
    for c in children_of(pid):
        out.append(c)
        out.extend(descendants(c))
    return out


def has_loaded(pid: int, package: str) -> bool:
    """Whether process ``pid`` has a file of the Python package ``package`` mapped (numpy's
    compiled modules, once it imported numpy)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f"/{package}/" in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def stop_up(up: subprocess.Popen, pids: list[int]) -> None:
    """Ctrl-C a ``ckpt up``; then kill, by pid, whatever of it (``pids`` seen earlier, and its
    children now) is still there."""
    up.send_signal(signal.SIGINT)
    try:
        up.wait(timeout=60)
    finally:
        for p in [*pids, *descendants(up.pid)]:
            if alive(p):
                os.kill(p, signal.SIGKILL)


class StorageWorker:
    def __init__(self, data: Path, env: dict[str, str], log: Path, key: str = KEY,
                 args: tuple[str, ...] = (), code: Path | None = None) -> None:
        """``code``: the source tree of another release to run (None: this one)."""
        self.data, self.env, self.log, self.key, self.args = data, env, log, key, args
        if code is not None:  # python -m puts its working directory first on the path
            self.env = {**env, "PYTHONPATH": str(code)}
        self.code = code
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> StorageWorker:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "worker", "--data", str(self.data), "--port", str(self.port),
                 *self.args],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.code)
        client = WorkerClient(self.url, self.key.encode(), auth.ANY_NODE)

        def up() -> bool:
            try:
                return bool(client.status())
            except WorkerError:
                assert self.proc.poll() is None, f"storage worker exited; see {self.log}"
                return False

        wait_for(up, 20, f"storage worker on {self.url}")
        return self

    def pids(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)] if self.proc else []

    @property
    def node_id(self) -> str:
        return (self.data / "node_id").read_text().strip()

    def shard(self, sha: str) -> Path:
        return self.data / "shards" / sha[:2] / sha[2:4] / sha

    def quarantined(self) -> list[str]:
        q = self.data / "quarantine"
        return sorted(p.name for p in q.iterdir()) if q.exists() else []

    def kill(self) -> None:
        """SIGKILL the worker and its gunicorn children, as a crash would: its process group at
        once (its own session). One by one, children first, the master forked a replacement
        for a killed child before its own kill, and the orphan served a restore a shard."""
        listed = self.pids()
        if self.proc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in listed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc:
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            pids = self.pids()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def storage_workers(tmp: Path, n: int, args: tuple[str, ...] = ()) -> Iterator[list[StorageWorker]]:
    """``n`` storage worker processes on loopback sharing one home (its cluster key), each with
    its own data directory; every one started is stopped afterwards, also when a later one
    failed to start."""
    ws: list[StorageWorker] = []
    try:
        for i in range(n):
            ws.append(StorageWorker(tmp / f"d{i}", base_env(tmp / "home"), tmp / f"w{i}.log", args=args))
            ws[-1].start()
        yield ws
    finally:
        for w in ws:
            w.stop()


def worker_client(w: StorageWorker) -> WorkerClient:
    """A client of ``w`` that expects its answers signed by it."""
    return WorkerClient(w.url, w.key.encode(), w.node_id)


def base_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update({"CKPT_HOME": str(home), "CKPT_CLUSTER_KEY": KEY, "PYTHONUNBUFFERED": "1"})
    env.update(FAST)
    env.update(extra)
    return env


class Cluster:
    """``ckpt up`` (embedded SQLite + Redis, real dramatiq, scheduler, watcher) with storage
    workers started by the test, so that a test can kill them."""

    def __init__(self, tmp: Path, *, workers: int = 3, env: dict[str, str] | None = None,
                 processes: int = 2, spare_workers: int = 0, static: bool = True) -> None:
        self.tmp = tmp
        self.home = tmp / "home"
        self.runs = tmp / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        (tmp / "logs").mkdir(exist_ok=True)
        self.extra_env = env or {}
        self.n_workers, self.processes, self.spare, self.static = workers, processes, spare_workers, static
        self.workers: list[StorageWorker] = []
        self.up_proc: subprocess.Popen | None = None
        self.known_pids: set[int] = set()

    @property
    def env(self) -> dict[str, str]:
        urls = ",".join(w.url for w in self.workers) if self.static else ""
        # Tests restore into their own tmp_path, next to (not under) this cluster's directory.
        return base_env(self.home, CKPT_ROOTS=str(self.runs / "*"), CKPT_WORKERS=urls,
                        CKPT_RESTORE_ROOTS=str(self.tmp.parent), **self.extra_env)

    def start(self) -> Cluster:
        for i in range(self.n_workers + self.spare):
            w = StorageWorker(self.tmp / f"worker{i}", base_env(self.home, **self.extra_env),
                              self.tmp / "logs" / f"worker{i}.log")
            # Spare workers are in CKPT_WORKERS but not running yet: a test starts them later.
            self.workers.append(w.start() if i < self.n_workers else w)
        with open(self.tmp / "logs" / "up.log", "ab") as out:
            self.up_proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "up", "--workers", "0", "--processes", str(self.processes)],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: (self.home / "up.json").exists() or self.up_proc.poll() is not None, 60, "ckpt up")
        assert self.up_proc.poll() is None, f"ckpt up exited; see {self.tmp / 'logs' / 'up.log'}"
        self.settings = settings_mod.load(environ=self.env)
        self._remember_pids()
        return self

    def up_info(self) -> dict:
        return json.loads((self.home / "up.json").read_text())

    def _remember_pids(self) -> None:
        if self.up_proc:
            self.known_pids.update([self.up_proc.pid, *descendants(self.up_proc.pid)])
        for w in self.workers:
            self.known_pids.update(w.pids())

    def worker(self, node_id: str) -> StorageWorker:
        return next(w for w in self.workers if w.node_id == node_id)

    def copies(self, checkpoint_path: Path, states: tuple[str, ...] = ("verified",)) -> list[tuple[str, str, int]]:
        """(worker id, shard sha256, shard seq) per copy of the checkpoint's tensor shards."""
        from sqlalchemy import select

        from pipeline.db.models import Checkpoint, CheckpointFile, ContentCopy, Shard

        with session_scope(self.settings.db_url) as s:
            return [(worker_id, sha, seq) for worker_id, sha, seq in s.execute(
                select(ContentCopy.worker_id, Shard.sha256, Shard.seq)
                .join(Shard, Shard.sha256 == ContentCopy.sha256).join(CheckpointFile).join(Checkpoint)
                .where(Checkpoint.path == str(checkpoint_path.resolve()), Checkpoint.current.is_(True),
                       ContentCopy.state.in_(states), Shard.kind == "safetensors")
                .order_by(Shard.seq, ContentCopy.worker_id))]

    def served(self) -> dict[int, int]:
        """{caller pid: the pid that ran its command} of every command ``ckpt up``'s command
        server ran (pipeline/service/commands.py)."""
        out = {}
        try:
            log = (self.home / "logs" / "commands.log").read_text()
        except FileNotFoundError:
            return out
        for line in log.splitlines():
            if ": ckpt " in line and " runs as pid " in line:
                caller = int(line.split(" pid ", 1)[1].split(":", 1)[0])
                out[caller] = int(line.rsplit(" runs as pid ", 1)[1])
        return out

    def ran_as(self, pid: int) -> int:
        """The process that ran the command of caller ``pid``: a child of the command server, or itself."""
        return self.served().get(pid, pid)

    def dramatiq_workers(self) -> list[int]:
        master = self.up_info()["children"]["dramatiq"]
        return children_of(master)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def job(self, job_id: int) -> Job:
        with session_scope(self.settings.db_url) as s:
            return s.get(Job, job_id)

    def wait_job(self, job_id: int, states: tuple[str, ...], timeout: float = 90) -> Job:
        def reached():
            job = self.job(job_id)
            if job.state in ("failed", "superseded") and job.state not in states:
                raise AssertionError(f"job {job_id} ended {job.state}: {job.last_error}\n{self.logs()}")
            ahead = reachable(job.kind, job.state)
            if ahead is not None and not set(states) & ahead:  # it went past them
                raise AssertionError(f"job {job_id} is {job.state}, from which none of {states} can be reached "
                                     f"(a test that polls for 'verified' alone races the rotation)")
            return job if job.state in states else None

        return wait_for(reached, timeout, f"job {job_id} to reach {states}", interval=0.2)

    def logs(self) -> str:
        out = []
        for p in sorted((self.home / "logs").glob("*.log")) + [self.tmp / "logs" / "up.log"]:
            try:
                lines = p.read_text(errors="replace").splitlines()[-15:]
            except FileNotFoundError:
                continue
            out.append(f"--- {p.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        self._remember_pids() if self.up_proc and self.up_proc.poll() is None else None
        if self.up_proc and self.up_proc.poll() is None:
            self.up_proc.send_signal(signal.SIGTERM)
            try:
                self.up_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.up_proc.kill()
        for w in self.workers:
            w.stop()
        leftover = {p: cmdline(p) for p in self.known_pids if alive(p)}
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        assert not leftover, f"processes outlived the cluster: {leftover}"


def reachable(kind: str, state: str) -> set[str] | None:
    """The states a ``kind`` job in ``state`` may still reach, ``state`` itself included
    (pipeline.states.TRANSITIONS; a failed job may be requeued); None: a kind without a table."""
    from pipeline.states import TRANSITIONS

    edges = TRANSITIONS.get(str(kind))
    if edges is None:
        return None
    seen, todo = {state}, [state]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def with_settings(s: settings_mod.Settings, **changes) -> settings_mod.Settings:
    return dataclasses.replace(s, **changes)
