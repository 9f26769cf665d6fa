"""The chaos soak's cluster: bench/cluster.py's box with a control host, two training hosts and
four storage hosts, each storage worker on a disk of its own.

- ``control``: ``ckpt up --workers 0`` (SQLite, embedded Redis, the Dramatiq master, the
  scheduler; its watcher watches an empty root).
- ``t1``, ``t2``: training hosts. Each runs the trainer (bench/chaos/trainer.py), a Dramatiq
  worker serving the shared queue and its own (``ckpt.host.tN``) and ``ckpt watch``, all with
  ``CKPT_HOST=tN``, on the control plane's database and broker. SQLite and the broker's unix
  socket are files, which every namespace reaches: a partition cuts a training host off from
  the storage workers, not from the control plane (a limit of the box; docs/design.md).
- ``s1``..``s4``: ``ckpt worker`` each, its data on an ext4 image of its own (a loop mount), so
  that a full disk is a real ENOSPC on that worker only.
- ``objstore``: the object store's front (bench/chaos/front.py), the only way into the S3 bucket
  (bench/chaos/bucket.py) that every process has as a ``[[targets]]`` target: run ``hf``
  ``required`` (rotation waits for the bucket's confirmed copies), run ``sft`` ``lag``.

The box acts as systemd does for the processes it started (``Restart=always``): one that dies
and is not held down on purpose is started again after ``RESTART_SECONDS``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.chaos.bucket import FRONT_PORT, REQUIRED_RUN, SoakBucket
from bench.cluster import Box

PORT = 7070
KEY = "chaos-soak-cluster-key"
TRAINERS = ("t1", "t2")
STORAGE = ("s1", "s2", "s3", "s4")
STORE = "objstore"
HOSTS = ["control", *TRAINERS, *STORAGE, STORE]
NORMAL_RATE = 1e9
RESTART_SECONDS = 2.0
PY = sys.executable


@dataclass
class Proc:
    host: str
    role: str
    argv: list[str]
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    held: bool = False  # down on purpose (a fault): not restarted
    died_at: float | None = None
    restarts: int = 0


class ChaosBox:
    """The namespaces, disks and processes of one soak; :meth:`down` removes all of them."""

    def __init__(self, root: Path, *, disk_bytes: int, env: dict[str, str], trainer: dict[str, object],
                 bucket: SoakBucket) -> None:
        self.root = root
        self.box = Box(root, NORMAL_RATE, hosts=list(HOSTS), prefix="cx")
        self.disk_bytes, self.extra_env, self.trainer = disk_bytes, env, trainer
        self.procs: dict[tuple[str, str], Proc] = {}
        self.mounts: list[Path] = []
        self.logs = root / "logs"
        self.control_home = root / "control-home"
        self.urls = {h: f"http://{self.box.addr[h]}:{PORT}" for h in STORAGE}
        self.bucket = bucket
        #: The front's mode file: ``throttle`` (503 SlowDown to every request) or ``pass``.
        self.store_mode = root / "objstore-mode"

    # -- layout --------------------------------------------------------------------------

    def disk(self, worker: str) -> Path:
        """The mount point of ``worker``'s own disk."""
        return self.root / f"disk-{worker}"

    def data(self, worker: str) -> Path:
        return self.disk(worker) / "store"

    def runs(self, host: str) -> Path:
        return self.root / f"train-{host}" / "runs"

    def ledger(self, host: str) -> Path:
        return self.root / f"ledger-{host}.jsonl"

    def restored(self, host: str) -> Path:
        return self.root / f"train-{host}" / "restored"

    def env(self, host: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "AWS_"))}
        base.update({
            "CKPT_CLUSTER_KEY": KEY, "CKPT_MDNS": "0", "CKPT_WEB_PORT": "0", "CKPT_SCRUB_CRON": "",
            "CKPT_GC_CRON": "", "CKPT_WORKERS": ",".join(self.urls.values()), "CKPT_HOST": host,
            "PYTHONUNBUFFERED": "1", "dramatiq_worker_timeout": "100", "HF_HUB_OFFLINE": "1",
            **self.bucket.env(f"http://{self.box.addr[STORE]}:{FRONT_PORT}", self.root),
            "CKPT_RUN_OPTIONS": json.dumps({str(self.runs("t*") / REQUIRED_RUN): {"target_mode": "required"}}),
            **self.extra_env,
        })
        if host == "control":
            base.update({"CKPT_HOME": str(self.control_home), "CKPT_ROOTS": str(self.root / "control-runs" / "*"),
                         "CKPT_RESTORE_ROOTS": str(self.root)})
        elif host in TRAINERS:
            base.update({"CKPT_HOME": str(self.root / f"home-{host}"),
                         "CKPT_DATABASE_URL": f"sqlite:///{self.control_home / 'ckpt.db'}",
                         "CKPT_REDIS_URL": f"unix://{self.control_home / 'redis' / 'redis.sock'}",
                         "CKPT_ROOTS": str(self.runs(host) / "*"), "CKPT_RESTORE_ROOTS": str(self.restored(host))})
        else:
            base["CKPT_HOME"] = str(self.root / f"home-{host}")
        return base

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.control_home / 'ckpt.db'}"

    @property
    def redis_socket(self) -> Path:
        return self.control_home / "redis" / "redis.sock"

    # -- bring up ------------------------------------------------------------------------

    def up(self) -> ChaosBox:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.box.up()
        for w in STORAGE:
            self._mount_disk(w)
        for h in TRAINERS:
            self.runs(h).mkdir(parents=True, exist_ok=True)
            self.restored(h).mkdir(parents=True, exist_ok=True)
        self.store_mode.write_text("pass")
        self.add(STORE, "front", [PY, "-m", "bench.chaos.front", self.box.addr[STORE], str(FRONT_PORT),
                                  str(self.bucket.socket), str(self.store_mode)])
        for w in STORAGE:
            self.add(w, "worker", [PY, "-m", "pipeline.cli", "worker", "--data", str(self.data(w)),
                                   "--host", self.box.addr[w], "--port", str(PORT)])
        self.add("control", "up", [PY, "-m", "pipeline.cli", "up", "--workers", "0", "--processes", "1",
                                   "--threads", "4"])
        wait(lambda: self.control_ready(), 180, "ckpt up on the control host", self.logs)
        for h in TRAINERS:
            self.add(h, "dramatiq", [PY, "-m", "dramatiq", "pipeline.tasks", "--processes", "1", "--threads", "4",
                                     "--queues", "ckpt", f"ckpt.host.{h}"])
            self.add(h, "watcher", [PY, "-m", "pipeline.cli", "watch"])
        return self

    def start_trainers(self) -> None:
        for i, h in enumerate(TRAINERS):
            t = self.trainer
            self.add(h, "trainer", [PY, "-m", "bench.chaos.trainer", "--host", h, "--runs", str(self.runs(h)),
                                    "--ledger", str(self.ledger(h)), "--stop", str(self.root / "stop-trainers"),
                                    "--mb", str(t["mb"][i]), "--every", *(str(x) for x in t["every"]),  # type: ignore[index]
                                    "--seed", str(int(t["seed"]) + i)])  # type: ignore[call-overload]

    def stop_trainers(self, timeout: float = 300) -> None:
        """Ask the trainers to stop after the save they are writing, and wait for them."""
        (self.root / "stop-trainers").touch()
        for h in TRAINERS:
            p = self.procs.get((h, "trainer"))
            if p is not None:
                p.held = True
                if p.popen and p.popen.poll() is None:
                    try:
                        p.popen.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        self.signal(p, signal.SIGKILL)

    def _mount_disk(self, worker: str) -> None:
        image, mnt = self.root / f"disk-{worker}.img", self.disk(worker)
        with open(image, "wb") as f:
            f.truncate(self.disk_bytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard", str(image)], check=True,
                       capture_output=True)
        mnt.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-o", "loop,discard", str(image), str(mnt)], check=True, capture_output=True)
        self.mounts.append(mnt)

    # -- processes -----------------------------------------------------------------------

    def add(self, host: str, role: str, argv: list[str]) -> Proc:
        p = Proc(host, role, argv, self.env(host))
        self.procs[(host, role)] = p
        self.start(p)
        return p

    def start(self, p: Proc) -> None:
        p.popen = self.box.start(p.host, p.argv, p.env, self.logs / f"{p.host}-{p.role}.log")
        p.died_at = None

    def alive(self, p: Proc) -> bool:
        return p.popen is not None and p.popen.poll() is None

    def signal(self, p: Proc, sig: int) -> None:
        """``sig`` to ``p``'s whole process group (a daemon and the processes it forked)."""
        if p.popen is not None and p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                p.popen.wait()

    def stop(self, p: Proc, timeout: float = 30) -> None:
        """SIGTERM, then SIGKILL: a graceful stop of ``p`` (held down until released)."""
        p.held = True
        if not self.alive(p):
            return
        self.signal(p, signal.SIGCONT)
        assert p.popen is not None
        p.popen.send_signal(signal.SIGTERM)
        try:
            p.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(p, signal.SIGKILL)

    def supervise(self) -> list[str]:
        """Start again what died and is not held down; what was restarted."""
        out = []
        now = time.monotonic()
        for p in self.procs.values():
            if p.held or self.alive(p):
                continue
            if p.died_at is None:
                p.died_at = now
            elif now - p.died_at >= RESTART_SECONDS:
                p.restarts += 1
                self.start(p)
                out.append(f"{p.host}/{p.role}")
        return out

    def control_children(self) -> dict[str, int]:
        """The PIDs of ``ckpt up``'s children (up.json), by name."""
        try:
            return dict(json.loads((self.control_home / "up.json").read_text())["children"])
        except (OSError, ValueError, KeyError):
            return {}

    def control_ready(self) -> bool:
        up = self.procs.get(("control", "up"))
        if up is None or not self.alive(up):
            return False
        kids = self.control_children()
        return bool(kids) and all(pid_alive(pid) for pid in kids.values())

    # -- tear down -----------------------------------------------------------------------

    def down(self) -> None:
        """Every process, namespace and mount of the box, also after a failure."""
        for p in self.procs.values():
            p.held = True
            self.signal(p, signal.SIGCONT)  # a stalled process cannot act on SIGTERM
        self.box.down()
        for mnt in self.mounts:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        for w in STORAGE:
            (self.root / f"disk-{w}.img").unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait(predicate, timeout: float, what: str, logs: Path | None = None, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            where = f"; see {logs}" if logs else ""
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{where}")
        time.sleep(interval)
    return value
