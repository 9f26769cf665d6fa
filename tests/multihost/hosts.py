"""Training hosts with disks of their own on a LAN in a box (tests/multihost/lan.py).

Each training host runs in its own network namespace and, through a private mount namespace,
sees its own disk at one shared path (``view``): the same path shows each host its own files,
as on real machines. PostgreSQL and Redis are on a services host; storage workers on h1..h3.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import make_url

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job, StorageWorker
from tests.conftest import POSTGRES_ADMIN_URL
from tests.multihost.lan import PORT, SVC_IP, Lan
from tests.processes import FAST, KEY, wait_for

#: Mount ``$1`` (the host's own disk) on ``$2`` (the path every host uses), then run the rest.
ON_OWN_DISK = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
PY = sys.executable


class TrainingHosts:
    """h1 and h2 train, each on its own disk at ``view``; h1..h3 run storage workers."""

    def __init__(self, tmp: Path, pg_name: str, local_url: str, runs: tuple[str, ...] = ("run",),
                 extra_env: dict[str, str] | None = None) -> None:
        self.tmp, self.pg_name, self.url, self.extra = tmp, pg_name, local_url, extra_env or {}
        self.lan = Lan()
        self.view = tmp / "data"
        self.view.mkdir()
        self.disks = {h: tmp / f"disk-{h}" for h in ("h1", "h2")}
        for d in self.disks.values():
            for run in runs:
                (d / "runs" / run).mkdir(parents=True)
        self.logs = tmp / "logs"
        self.logs.mkdir()

    def env(self, host: str) -> dict[str, str]:
        workers = ",".join(f"http://{self.lan.addr[h]}:{PORT}" for h in ("h1", "h2", "h3"))
        user = make_url(POSTGRES_ADMIN_URL).username or "postgres"
        e = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        e.update(FAST)
        e.update({
            "CKPT_HOME": str(self.tmp / f"home-{host}"), "CKPT_CLUSTER_KEY": KEY, "PYTHONUNBUFFERED": "1",
            "CKPT_DATABASE_URL": f"postgresql+psycopg://{user}@{SVC_IP}:5432/{self.pg_name}",
            "CKPT_REDIS_URL": f"redis://{SVC_IP}:6390/0", "CKPT_WORKERS": workers, "CKPT_HOST": host,
            "CKPT_ROOTS": str(self.view / "runs" / "*"), "CKPT_KEEP_LAST": "1", "CKPT_RESTORE_ROOTS": str(self.view),
            "dramatiq_worker_timeout": FAST["CKPT_POLL_MS"], "CKPT_SCRUB_CRON": "", "CKPT_GC_CRON": "",
        })
        e.update(self.extra)
        return e

    def on_disk(self, host: str, argv: list[str]) -> list[str]:
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", ON_OWN_DISK, "sh",
                str(self.disks[host]), str(self.view), *argv]

    def up(self) -> None:
        """The LAN, its services, storage workers, and on each training host Dramatiq (its own
        queue and the shared one) and a watcher; the scheduler on h2."""
        lan = self.lan
        lan.up()
        lan.start_services(self.env("svc"), self.logs)
        lan.start_storage_workers(("h1", "h2", "h3"), self.env, lambda h: self.tmp / f"store-{h}", self.logs)
        for h in ("h1", "h2"):
            self.dramatiq(h)
            self.watcher(h)
        lan.run("h2", [PY, "-m", "pipeline.cli", "scheduler"], self.env("h2"), self.logs / "scheduler.log")
        wait_for(lambda: len([w for w in self.workers().values() if w == "up"]) == 3, 60, "3 workers up")

    def dramatiq(self, h: str) -> subprocess.Popen:
        return self.lan.run(h, self.on_disk(h, [PY, "-m", "dramatiq", "pipeline.tasks", "--processes", "1",
                                                "--threads", "4", "--queues", "ckpt", f"ckpt.host.{h}"]),
                            self.env(h), self.logs / f"dramatiq-{h}.log")

    def watcher(self, h: str) -> subprocess.Popen:
        return self.lan.run(h, self.on_disk(h, [PY, "-m", "pipeline.cli", "watch"]), self.env(h),
                            self.logs / f"watcher-{h}.log")

    def run_in(self, host: str, argv: list[str], env: dict[str, str] | None = None,
               timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.lan.ns[host], *argv], env=env or self.env(host),
                              capture_output=True, text=True, timeout=timeout)

    def checkpoints(self) -> dict[tuple[str | None, str], tuple[str | None, bool, bool]]:
        """(host, name) -> (store state, current, local copy)"""
        with session_scope(self.url) as s:
            out = {}
            for c in s.scalars(select(Checkpoint)):
                job = s.scalar(select(Job).where(Job.checkpoint_id == c.id, Job.kind == "store")
                               .order_by(Job.id.desc()).limit(1))
                out[(c.host, c.name)] = (job.state if job else None, c.current, c.local_present)
            return out

    def workers(self) -> dict[str, str]:
        with session_scope(self.url) as s:
            return {w.url: w.state for w in s.scalars(select(StorageWorker))}

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.iterdir()))

    def down(self) -> None:
        self.lan.down()
