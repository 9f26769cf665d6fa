"""Discovery scenario, run by test_discovery.py inside a private network namespace.

Two storage workers with the cluster key announce themselves on mDNS (loopback of the
namespace), and so do two strangers: a worker of another cluster (its advert carries another
fingerprint: ignored, never recorded) and an impersonator (an advert copying this cluster's
public fingerprint, pointing at a worker without the key: recorded as a candidate, fails the
challenge, forgotten). ckpt up has no static worker list. Prints one JSON document with what
happened.
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
        impersonator = _advertise_as_this_cluster("w-impostor00", rogue.port)
        t0 = time.monotonic()
        cluster.start()
        from sqlalchemy import select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import StorageWorker as Row

        def workers() -> dict:
            with session_scope(cluster.settings.db_url) as s:
                return {w.url: (w.id, w.state, w.source) for w in s.scalars(select(Row))}

        log = cluster.home / "logs" / "scheduler.log"

        def settled() -> bool:
            ws = workers()
            ups = [w for w in ws.values() if w[1] == "up"]
            said = log.read_text() if log.exists() else ""
            return (len(ups) == 2 and rogue.url not in ws and "of another cluster" in said
                    and f"forgetting w-impostor00 at {rogue.url}" in said)

        wait_for(settled, 60, "two admitted workers, the stranger ignored, the impersonator forgotten",
                 interval=0.2)
        discovered_in = time.monotonic() - t0
        run = cluster.runs / "run"
        run.mkdir()
        path = atomic_save(state_dict(5), run / "step_1.safetensors")
        from tests.integration.conftest import checkpoint_job

        job = cluster.wait_job(checkpoint_job(cluster, path), ("verified",), timeout=90)
        rogue_files = [p.name for p in (rogue.data / "shards").rglob("*") if p.is_file()]
        impersonator.close()
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


def _advertise_as_this_cluster(node: str, port: int):
    """An mDNS advert that copies this cluster's fingerprint (anyone on the LAN can read it)."""
    import socket

    from zeroconf import ServiceInfo, Zeroconf

    from pipeline.cluster.discovery import SERVICE, fingerprint
    from tests.processes import KEY

    zc = Zeroconf(interfaces=["127.0.0.1"])
    info = ServiceInfo(SERVICE, f"{node}.{SERVICE}", addresses=[socket.inet_aton("127.0.0.1")], port=port,
                       properties={"node": node, "api": "1", "zone": "", "cluster": fingerprint(KEY.encode())},
                       server=f"{node}.local.")
    zc.register_service(info)
    return zc


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
