"""Discovery scenario, run by test_discovery.py inside a private network namespace.

Two storage workers with the cluster key and one rogue advertiser without it announce
themselves on mDNS (loopback of the namespace); ckpt up has no static worker list. Prints
one JSON document with what happened.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.checkpoints import atomic_save, state_dict
from tests.processes import Cluster, StorageWorker, base_env, wait_for

MDNS = {"CKPT_MDNS": "1", "CKPT_MDNS_INTERFACES": "127.0.0.1", "CKPT_SCRUB_CRON": ""}


def main(tmp: Path) -> dict:
    cluster = Cluster(tmp / "c", workers=2, env=MDNS, static=False)
    rogue = None
    try:
        home = tmp / "rogue-home"
        rogue = StorageWorker(tmp / "rogue", base_env(home, CKPT_CLUSTER_KEY="not-the-cluster-key", **MDNS),
                              tmp / "rogue.log", key="not-the-cluster-key").start()
        t0 = time.monotonic()
        cluster.start()
        from sqlalchemy import select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import StorageWorker as Row

        def workers() -> dict:
            with session_scope(cluster.settings.db_url) as s:
                return {w.url: (w.id, w.state, w.source) for w in s.scalars(select(Row))}

        def settled() -> bool:
            ws = workers()
            ups = [w for w in ws.values() if w[1] == "up"]
            return len(ups) == 2 and ws.get(rogue.url, (None, None))[1] == "rejected"

        wait_for(settled, 60, "two admitted workers and one rejected advertiser", interval=0.2)
        discovered_in = time.monotonic() - t0
        run = cluster.runs / "run"
        run.mkdir()
        path = atomic_save(state_dict(5), run / "step_1.safetensors")
        from tests.integration.conftest import checkpoint_job

        job = cluster.wait_job(checkpoint_job(cluster, path), ("verified",), timeout=90)
        rogue_files = [p.name for p in (rogue.data / "shards").rglob("*") if p.is_file()]
        return {
            "workers": {url: list(v) for url, v in workers().items()},
            "good_urls": [w.url for w in cluster.workers],
            "rogue_url": rogue.url,
            "store_state": job.state,
            "rogue_files": rogue_files,
            "discovered_in_s": round(discovered_in, 2),
        }
    finally:
        try:
            cluster.stop()
        finally:
            if rogue is not None:
                rogue.stop()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
