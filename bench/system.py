"""The real system for the benchmark: ``ckpt up`` with 3 local storage workers, RF 2."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.elsewhere import Elsewhere
from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.liveness import stat_fields


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphan if the bench dies


def descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []
    return [k for c in kids for k in (c, *descendants(c))]


def peak_rss_kib(pid: int) -> int | None:
    """VmHWM: the process's peak resident set, from the OS."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants (the dead ones its waited-for children's time holds)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            fields = stat_fields(p)
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


class System:
    #: Settings every system of this run gets (``--replication``).
    common: dict[str, str] = {}

    def __init__(self, root: Path, *, up_args: tuple[str, ...] = (), workers_elsewhere: bool = False,
                 **env: str) -> None:
        self.root, self.home, self.runs = root, root / "home", root / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        self.env.update({"CKPT_HOME": str(self.home), "CKPT_ROOTS": str(self.runs / "*"), "CKPT_MDNS": "0",
                         "CKPT_WEB_PORT": "0", "CKPT_SCRUB_CRON": "", "CKPT_KEEP_LAST": "1000",
                         "CKPT_TICK_SECONDS": "0.5",
                         "CKPT_RESTORE_ROOTS": str(root.parent), **self.common, **env})  # restores go next to it
        self.proc: subprocess.Popen | None = None
        #: Whether the last command ran in a process ckpt up's command server forked for it.
        self.last_served = False
        self.up_args = up_args  # more options of `ckpt up`
        #: The 3 storage workers started apart from `ckpt up`, in cgroups of their own beside this
        #: process's (bench.elsewhere): on a machine that runs the bench confined, the other machines.
        self.workers_elsewhere = workers_elsewhere
        self.workers: list[subprocess.Popen] = []
        self.elsewhere = Elsewhere()

    def _start_workers_elsewhere(self) -> None:
        from pipeline.cluster.client import free_port

        urls = []
        for i in range(3):
            port = free_port()
            log = open(self.root / f"worker-{i}.log", "wb")
            w = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", "--data", str(self.root / f"w{i}"),
                                  "--port", str(port), "--host", "127.0.0.1"], env=self.env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
            self.elsewhere.place(w.pid)
            self.workers.append(w)
            urls.append(f"http://127.0.0.1:{port}")
        self.env["CKPT_WORKERS"] = ",".join(urls)

    def __enter__(self) -> System:
        log = open(self.root / "up.log", "wb")
        if self.workers_elsewhere:
            self._start_workers_elsewhere()
        local = "0" if self.workers_elsewhere else "3"
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "up", "--workers", local, *self.up_args],
                                     env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 60
        while not (self.home / "up.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ckpt up did not start; see {self.root / 'up.log'}")
            time.sleep(0.1)
        self.settings = settings_mod.configure(settings_mod.load(environ=self.env))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=90)
        for w in self.workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
                w.wait(timeout=60)
        self.elsewhere.remove()

    def cli(self, *args: str, **env: str) -> tuple[float, int, str]:
        """Run ``ckpt ARGS``; (seconds, peak RSS KiB of that process, stdout).

        The peak is VmHWM read from /proc while the child runs: it starts over at exec, so it
        does not count the benchmark's own pages that fork shared with the child before exec
        (ru_maxrss does).
        """
        t = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], env={**self.env, **env},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        peak = 0
        exe = None
        served = None  # the process ckpt up's command server forked to run it (pipeline/service/commands.py)
        while p.poll() is None:
            if exe is None and "pipeline.cli" in cmdline(p.pid):
                exe = True
            if exe:
                peak = max(peak, peak_rss_kib(p.pid) or 0)
            if served is None:
                served = self._served_as(p.pid)
            if served is not None:
                peak = max(peak, peak_rss_kib(served) or 0)
            time.sleep(0.02)
        out, err = p.stdout.read().decode(), p.stderr.read().decode()
        seconds = time.perf_counter() - t
        self.last_served = served is not None or self._served_as(p.pid) is not None
        if p.returncode != 0:
            raise RuntimeError(f"ckpt {' '.join(args)} failed: {err[-2000:]}")
        return seconds, peak, out

    def _served_as(self, pid: int) -> int | None:
        try:
            log = (self.home / "logs" / "commands.log").read_text()
        except FileNotFoundError:
            return None
        marker = f"pid {pid}: ckpt "
        for line in reversed(log.splitlines()):
            if marker in line and " runs as pid " in line:
                return int(line.rsplit(" runs as pid ", 1)[1])
        return None

    def processes(self) -> dict[str, int]:
        """Peak RSS (KiB) of every process of the system, by role."""
        info = json.loads((self.home / "up.json").read_text())
        out: dict[str, int] = {}
        for role, pid in info["children"].items():
            for i, p in enumerate([pid, *descendants(pid)]):
                rss = peak_rss_kib(p)
                if rss is not None:
                    name = role if i == 0 else f"{role}/child{i}"
                    out[name] = rss
        out["ckpt up"] = peak_rss_kib(self.proc.pid) or 0
        return out

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds each child of ``ckpt up`` (with what it forked) and ``ckpt up`` itself used so far."""
        info = json.loads((self.home / "up.json").read_text())
        out = {role: cpu_seconds(pid) for role, pid in info["children"].items()}
        try:
            out["ckpt up"] = sum(int(x) for x in stat_fields(self.proc.pid)[11:13]) / os.sysconf("SC_CLK_TCK")
        except (OSError, AttributeError):
            pass
        return out

    def job(self, job_id: int) -> Job:
        with session_scope(self.settings.db_url) as s:
            return s.get(Job, job_id)


def store(system: System, path: Path) -> dict:
    seconds, rss, out = system.cli("store", str(path), "--wait")
    job_id = int(re.search(r"job (\d+)", out).group(1))
    ckpt_id = int(re.search(r"checkpoint (\d+)", out).group(1))
    assert system.job(job_id).state == "verified", out
    return {"seconds": seconds, "cli_rss_kib": rss, "job_id": job_id, "checkpoint_id": ckpt_id}


def restore(system: System, ckpt_id: int, dest: Path, **env: str) -> dict:
    seconds, rss, _ = system.cli("restore", str(ckpt_id), "--to", str(dest), "--wait", **env)
    return {"seconds": seconds, "cli_rss_kib": rss}


def replica_files(system: System, ckpt_id: int) -> list[Path]:
    """One stored copy of every shard of a checkpoint, in file order: what a restore reads."""
    from sqlalchemy import select

    from pipeline.db.models import CheckpointFile, Shard

    with session_scope(system.settings.db_url) as s:
        shas = s.scalars(select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == ckpt_id)
                         .order_by(CheckpointFile.relpath, Shard.seq)).all()
    out = []
    for sha in shas:
        held = sorted(system.home.glob(f"workers/*/shards/{sha[:2]}/{sha[2:4]}/{sha}"))
        if not held:
            raise RuntimeError(f"no stored copy of shard {sha[:12]} under {system.home}/workers")
        out.append(held[0])
    return out
