"""Three "hosts" (network namespaces joined by veth pairs on a bridge), PostgreSQL and Redis
as shared services on a fourth: store, cut one host off (link down), store and restore
without it, bring it back.

Nothing here touches the machine's real interfaces: every interface is created inside a
namespace this test owns and deletes. PostgreSQL is the machine's own, reached through its
Unix socket (a file, shared by every namespace) by a forwarder in the services namespace.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from sqlalchemy import select
from sqlalchemy.engine import make_url

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    ContentCopy,
    Job,
    Shard,
    StorageWorker,
)
from tests.checkpoints import atomic_save, state_dict
from tests.conftest import (
    POSTGRES_ADMIN_URL,
)
from tests.multihost.lan import MARKS, PORT, SVC_IP, Lan
from tests.processes import FAST, KEY, descendants, has_loaded, wait_for

pytestmark = MARKS


def test_store_cut_a_host_off_restore_bring_it_back(tmp_path, pg_database):
    pg_database, local_url = pg_database
    upgrade(local_url)
    lan = Lan()
    runs = tmp_path / "runs"
    (runs / "run").mkdir(parents=True)
    logs = tmp_path / "logs"
    logs.mkdir()
    workers = ",".join(f"http://{lan.addr[h]}:{PORT}" for h in ("h1", "h2", "h3"))
    user = make_url(POSTGRES_ADMIN_URL).username or "postgres"

    def env(host: str) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        e.update(FAST)
        e.update({
            "CKPT_HOME": str(tmp_path / host), "CKPT_CLUSTER_KEY": KEY, "PYTHONUNBUFFERED": "1",
            "CKPT_DATABASE_URL": f"postgresql+psycopg://{user}@{SVC_IP}:5432/{pg_database}",
            "CKPT_REDIS_URL": f"redis://{SVC_IP}:6390/0", "CKPT_WORKERS": workers,
            "CKPT_ROOTS": str(runs / "*"), "CKPT_KEEP_LAST": "5", "dramatiq_worker_timeout": FAST["CKPT_POLL_MS"],
            "CKPT_HOST": host, "CKPT_RESTORE_ROOTS": str(tmp_path),  # restored next to the runs, not in them
            # Between hosts, compressed whatever the load on this machine's two cores (``auto``
            # backs off while they are busy, as they are while the other lane's cluster runs).
            "CKPT_WIRE_COMPRESSION": "on",
        })
        return e

    py = sys.executable
    lan.up()
    try:
        lan.start_services(env("svc"), logs)
        lan.start_storage_workers(("h1", "h2", "h3"), env, lambda h: tmp_path / h / "data", logs)
        dramatiq = [lan.run(h, [py, "-m", "dramatiq", "pipeline.tasks", "--processes", "1", "--threads", "4",
                                "--queues", "ckpt", f"ckpt.host.{h}"], env(h), logs / f"dramatiq-{h}.log")
                    for h in ("h1", "h2")]
        lan.run("h1", [py, "-m", "pipeline.cli", "scheduler"], env("h1"), logs / "scheduler.log")
        lan.run("h1", [py, "-m", "pipeline.cli", "watch"], env("h1"), logs / "watcher.log")

        def workers_up() -> dict[str, str]:
            with session_scope(local_url) as s:
                return {w.url: w.state for w in s.scalars(select(StorageWorker))}

        def log_tail() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.iterdir()))

        def state_of(path: Path) -> str | None:
            with session_scope(local_url) as s:
                return s.scalar(select(Job.state).join(Checkpoint, Job.checkpoint_id == Checkpoint.id)
                                .where(Checkpoint.path == str(path), Job.kind == "store")
                                .order_by(Job.id.desc()).limit(1))

        try:
            wait_for(lambda: list(workers_up().values()).count("up") == 3, 60, "three storage workers up")
            # Frames are coming to every storage worker (bound to its LAN address), and from the
            # Dramatiq processes and the watcher (early sends; their workers are on other hosts):
            # each loaded the codec before the first store, not inside it (pipeline/service/warmth.py).
            storage = [p for p in lan.procs if "worker" in p.args]
            watcher = [p for p in lan.procs if "watch" in p.args]
            assert len(storage) == 3 and len(dramatiq) == 2 and len(watcher) == 1
            wait_for(lambda: all(any(has_loaded(q, "numpy") for q in (p.pid, *descendants(p.pid)))
                                 for p in dramatiq + storage + watcher), 30,
                     "the codec loaded in every worker, Dramatiq and the watcher")
            # bf16 weights: between hosts their shards cross compressed (planes frames, pipeline/cluster/wire.py)
            first = atomic_save(state_dict(1, layers=12, dtype=torch.bfloat16), runs / "run" / "step_1.safetensors")
            wait_for(lambda: state_of(first) == "verified", 90, "the first checkpoint verified")

            def compressed(hosts: tuple[str, ...], way: str) -> tuple[int, int, int]:
                """Shards, raw and wire bytes the workers on ``hosts`` moved compressed."""
                out = [0, 0, 0]
                for h in hosts:
                    url = f"http://{lan.addr[h]}:{PORT}"
                    with session_scope(local_url) as s:
                        node = s.scalar(select(StorageWorker.id).where(StorageWorker.url == url))
                    ask = ("import json; from pipeline.cluster.client import WorkerClient; "
                           f"print(json.dumps(WorkerClient({url!r}, {KEY!r}.encode(), {node!r}).status()))")
                    r = subprocess.run(["ip", "netns", "exec", lan.ns["svc"], py, "-c", ask], env=env("svc"),
                                       capture_output=True, text=True, timeout=60)  # asked from the LAN
                    assert r.returncode == 0, r.stderr
                    z = json.loads(r.stdout)["zstd"]
                    for i, k in enumerate(("shards", "raw", "wire")):
                        out[i] += z.get(f"{way}_{k}", 0)
                return out[0], out[1], out[2]

            # h1's watcher and dramatiq send to h2's and h3's workers over the LAN, compressed; to
            # its own worker as they are (loopback gains nothing).
            shards, raw, wire = compressed(("h2", "h3"), "received")
            assert shards and wire < 0.9 * raw, (shards, raw, wire)

            def hosts_holding(path: Path) -> set[str]:
                with session_scope(local_url) as s:
                    return set(s.scalars(
                        select(StorageWorker.url).join(ContentCopy, ContentCopy.worker_id == StorageWorker.id)
                        .join(Shard, Shard.sha256 == ContentCopy.sha256).join(CheckpointFile).join(Checkpoint)
                        .where(Checkpoint.path == str(path), ContentCopy.state == "verified")))

            h3 = f"http://{lan.addr['h3']}:{PORT}"
            assert h3 in hosts_holding(first)  # so restoring it must do without some copies
            lan.link("h3", "down")  # h3 is cut off: its worker and its copies are unreachable
            wait_for(lambda: workers_up().get(h3) == "down", 60, "h3 seen down")
            second = atomic_save(state_dict(2, layers=6), runs / "run" / "step_2.safetensors")
            wait_for(lambda: state_of(second) == "verified", 120, "a checkpoint verified without h3")
            assert h3 not in hosts_holding(second)
            for path in (first, second):
                dest = tmp_path / f"restored-{path.name}"
                r = subprocess.run(["ip", "netns", "exec", lan.ns["h2"], py, "-m", "pipeline.cli", "restore",
                                    str(path), "--to", str(dest), "--wait"], env=env("h2"), capture_output=True,
                                   text=True, timeout=180)
                assert r.returncode == 0, r.stderr + log_tail()
                assert dest.read_bytes() == path.read_bytes()
            shards, raw, wire = compressed(("h1",), "sent")  # h2 restored from h1's worker too, compressed
            assert shards and wire < 0.9 * raw, (shards, raw, wire)

            lan.link("h3", "up")
            wait_for(lambda: workers_up().get(h3) == "up", 60, "h3 back up")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log_tail()}") from None
    finally:
        lan.down()
