"""Two training hosts with disks of their own (a mount namespace each: the same path shows each
host its own files), each with its watcher and Dramatiq workers; PostgreSQL and Redis shared on
a services host; storage workers on three hosts. Both hosts write the same paths.

Checked: every checkpoint of both hosts is protected; each host rotates its own old checkpoints
from its own disk (never the other's, never "rotated" without deleting); a restore by path on a
host gives that host's checkpoint back; with one host cut off, the other's work goes on and the
cut-off host's checkpoints are left as they were (nothing superseded, vanished or rotated).
"""
from __future__ import annotations

import os
import sys

from sqlalchemy import select
from sqlalchemy.engine import make_url

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint, Job, StorageWorker, TrainingHost
from tests.checkpoints import atomic_save, state_dict
from tests.conftest import POSTGRES_ADMIN_URL
from tests.multihost.lan import MARKS, PORT, SVC_IP, Lan
from tests.processes import FAST, KEY, wait_for

pytestmark = MARKS
#: Mount ``$1`` (the host's own disk) on ``$2`` (the path every host uses), then run the rest.
ON_OWN_DISK = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'


def test_each_host_protects_rotates_and_restores_its_own_checkpoints(tmp_path, pg_database):
    pg_name, local_url = pg_database
    upgrade(local_url)
    lan = Lan()
    view = tmp_path / "data"  # the path both hosts write to: each sees its own disk there
    view.mkdir()
    disks = {h: tmp_path / f"disk-{h}" for h in ("h1", "h2")}
    for d in disks.values():
        (d / "runs" / "run").mkdir(parents=True)
    logs = tmp_path / "logs"
    logs.mkdir()
    workers = ",".join(f"http://{lan.addr[h]}:{PORT}" for h in ("h1", "h2", "h3"))
    user = make_url(POSTGRES_ADMIN_URL).username or "postgres"
    py = sys.executable

    def env(host: str) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        e.update(FAST)
        e.update({
            "CKPT_HOME": str(tmp_path / f"home-{host}"), "CKPT_CLUSTER_KEY": KEY, "PYTHONUNBUFFERED": "1",
            "CKPT_DATABASE_URL": f"postgresql+psycopg://{user}@{SVC_IP}:5432/{pg_name}",
            "CKPT_REDIS_URL": f"redis://{SVC_IP}:6390/0", "CKPT_WORKERS": workers, "CKPT_HOST": host,
            "CKPT_ROOTS": str(view / "runs" / "*"), "CKPT_KEEP_LAST": "1", "CKPT_RESTORE_ROOTS": str(view),
            "dramatiq_worker_timeout": "100", "CKPT_SCRUB_CRON": "", "CKPT_GC_CRON": "",
        })
        return e

    def on_disk(host: str, argv: list[str]) -> list[str]:
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", ON_OWN_DISK, "sh",
                str(disks[host]), str(view), *argv]

    def checkpoints() -> dict[tuple[str, str], tuple[str, bool, bool]]:
        """(host, name) -> (store state, current, local copy)"""
        with session_scope(local_url) as s:
            out = {}
            for c in s.scalars(select(Checkpoint)):
                job = s.scalar(select(Job).where(Job.checkpoint_id == c.id, Job.kind == "store")
                               .order_by(Job.id.desc()).limit(1))
                out[(c.host, c.name)] = (job.state if job else None, c.current, c.local_present)
            return out

    def log_tail() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.iterdir()))

    lan.up()
    try:
        lan.start_services(env("svc"), logs)
        lan.start_storage_workers(("h1", "h2", "h3"), env, lambda h: tmp_path / f"store-{h}", logs)
        for h in ("h1", "h2"):
            lan.run(h, on_disk(h, [py, "-m", "dramatiq", "pipeline.tasks", "--processes", "1", "--threads", "4",
                                   "--queues", "ckpt", f"ckpt.host.{h}"]), env(h), logs / f"dramatiq-{h}.log")
            lan.run(h, on_disk(h, [py, "-m", "pipeline.cli", "watch"]), env(h), logs / f"watcher-{h}.log")
        lan.run("h2", [py, "-m", "pipeline.cli", "scheduler"], env("h2"), logs / "scheduler.log")
        try:
            wait_for(lambda: len([w for w in _workers(local_url).values() if w == "up"]) == 3, 60, "3 workers up")
            # Both hosts save the same names, with different bytes, on their own disks.
            saved: dict[tuple[str, str], bytes] = {}
            for step in (1, 2):
                for i, h in enumerate(("h1", "h2")):
                    p = atomic_save(state_dict(10 * step + i),
                                    disks[h] / "runs" / "run" / f"step_{step}.safetensors")
                    saved[(h, p.name)] = p.read_bytes()
            want = {(h, f"step_{n}.safetensors") for h in ("h1", "h2") for n in (1, 2)}
            wait_for(lambda: {k for k, (st, _c, _l) in checkpoints().items() if st in ("verified", "rotated")}
                     >= want, 120, "the four checkpoints protected")
            # keep-last 1, per host: each host's step_1 rotated, from its own disk only
            wait_for(lambda: all(checkpoints()[(h, "step_1.safetensors")][0] == "rotated" for h in ("h1", "h2")),
                     90, "each host's step_1 rotated")
            for h in ("h1", "h2"):
                assert not (disks[h] / "runs" / "run" / "step_1.safetensors").exists()
                kept = disks[h] / "runs" / "run" / "step_2.safetensors"
                assert kept.read_bytes() == saved[(h, "step_2.safetensors")]
            assert len(checkpoints()) == 4  # nothing recorded twice, nothing superseded by the other host
            with session_scope(local_url) as s:  # each host's watcher reports it in
                assert set(s.scalars(select(TrainingHost.name))) == {"h1", "h2"}
            # A restore by path on h2 gives h2's step_1 back, into h2's disk.
            r = _run_in(lan, "h2", on_disk("h2", [py, "-m", "pipeline.cli", "restore",
                                                  str(view / "runs" / "run" / "step_1.safetensors"),
                                                  "--to", str(view / "restored.safetensors"), "--wait"]), env("h2"))
            assert r.returncode == 0, r.stderr + log_tail()
            assert (disks["h2"] / "restored.safetensors").read_bytes() == saved[("h2", "step_1.safetensors")]
            assert not (disks["h1"] / "restored.safetensors").exists()

            # h1 is cut off: its checkpoints stay as they are; h2 goes on.
            before = {k: v for k, v in checkpoints().items() if k[0] == "h1"}
            lan.link("h1", "down")
            p = atomic_save(state_dict(99), disks["h2"] / "runs" / "run" / "step_3.safetensors")
            wait_for(lambda: checkpoints().get(("h2", p.name), (None,))[0] in ("verified", "rotated"), 120,
                     "h2's step_3 protected without h1")
            wait_for(lambda: checkpoints()[("h2", "step_2.safetensors")][0] == "rotated", 90, "h2 rotating on")
            assert {k: v for k, v in checkpoints().items() if k[0] == "h1"} == before
            kept = disks["h1"] / "runs" / "run" / "step_2.safetensors"
            assert kept.read_bytes() == saved[("h1", "step_2.safetensors")]
        except AssertionError:
            raise AssertionError(log_tail()) from None
    finally:
        lan.down()


def _workers(url: str) -> dict[str, str]:
    with session_scope(url) as s:
        return {w.url: w.state for w in s.scalars(select(StorageWorker))}


def _run_in(lan: Lan, host: str, argv: list[str], env: dict[str, str]):
    import subprocess

    return subprocess.run(["ip", "netns", "exec", lan.ns[host], *argv], env=env, capture_output=True, text=True,
                          timeout=180)
