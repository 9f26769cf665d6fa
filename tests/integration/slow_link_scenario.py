"""A store over a link far slower than the lease, run by test_slow_link.py inside a private
network namespace whose loopback is shaped with ``tc tbf``.

The whole system runs (ckpt up with two storage workers, dramatiq, the scheduler) with a
2 s lease; one shard takes several seconds to upload. Prints one JSON document with what
happened: every copy must have been uploaded once, the job never re-driven, never failed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.processes import Cluster

RATE = "12mbit"  # 1.5 MB/s: a 6 MB shard takes ~4 s per copy, two copies share the link
LEASE = "2"  # renewed by time every third of it; 1 s left a loaded machine (the full suite) no slack


def main(tmp: Path) -> dict:
    from sqlalchemy import select

    from pipeline.db.engine import session_scope
    from pipeline.db.models import ContentCopy, Job
    from tests.integration.conftest import checkpoint_job

    # lo's 64 KiB MTU would not fit a small token bucket (tbf drops a packet larger than its
    # burst): an Ethernet-sized MTU, as on a real link.
    subprocess.run(["ip", "link", "set", "lo", "mtu", "1500"], check=True)
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", RATE, "burst", "256kb",
                    "latency", "100ms"], check=True)
    cluster = Cluster(tmp / "c", workers=2, env={"CKPT_LEASE_SECONDS": LEASE, "CKPT_SHARD_SIZE": str(8 << 20),
                                                 "CKPT_SCRUB_CRON": "", "CKPT_MDNS": "0"})
    try:
        cluster.start()
        run = cluster.runs / "run"
        run.mkdir()
        tmp_file = run / ".m.safetensors.tmp"
        save_file({"w": torch.randn((6 << 20) // 4)}, str(tmp_file))  # 6 MiB of float32: one shard
        path = run / "m.safetensors"
        tmp_file.rename(path)
        t0 = time.monotonic()
        job_id = checkpoint_job(cluster, path)
        job = cluster.wait_job(job_id, ("verified", "rotated", "failed"), timeout=120)
        took = time.monotonic() - t0
        with session_scope(cluster.settings.db_url) as s:
            attempts = [c.attempts for c in s.scalars(select(ContentCopy))]
            state = s.get(Job, job_id).state
        log = (cluster.home / "logs" / "scheduler.log").read_text()
        redriven = [ln for ln in log.splitlines() if f"job {job_id} (" in ln and "re-driving" in ln]
        return {"state": state, "job_state_seen": job.state, "seconds": round(took, 2), "lease_s": float(LEASE),
                "copy_attempts": attempts, "redriven": redriven, "size": path.stat().st_size}
    finally:
        cluster.stop()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
