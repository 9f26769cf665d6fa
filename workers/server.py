"""``ckpt worker``: the storage worker daemon behind gunicorn (threaded workers).

gunicorn, not the werkzeug development server (pipeline.service.serving): it serves long uploads
in threads, streams responses with sendfile, and shuts down gracefully on SIGTERM.
"""
from __future__ import annotations

import logging
import os
import secrets
from typing import Any

from pipeline import codec
from pipeline.cluster.wire import is_loopback
from pipeline.durable import fsync_dir
from pipeline.service.serving import run
from workers.app import WorkerApp
from workers.shardstore import ShardStore

log = logging.getLogger("ckpt.worker")


def node_id_for(data_dir: str) -> str:
    """The worker's stable identity, kept in ``<data>/node_id`` (created on first start)."""
    path = os.path.join(data_dir, "node_id")
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        pass
    os.makedirs(data_dir, exist_ok=True)
    node = "w-" + secrets.token_hex(6)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(node)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(data_dir)
    return node


def serve(data_dir: str, *, host: str, port: int, key: bytes, zone: str = "", threads: int = 8,
          capacity: int = 0, max_skew: float = 300.0, max_upload: int = 0,
          advertise_on: tuple[str, ...] = (), urls: tuple[str, ...] = (), compress: str = "auto") -> None:
    """Run the storage worker in the foreground until SIGTERM/SIGINT.

    With ``advertise_on`` (zeroconf interface addresses, or ("all",)), the worker is
    announced on mDNS while it runs.
    """
    store = ShardStore(data_dir, capacity=capacity)
    node = node_id_for(data_dir)
    app = WorkerApp(store, key=key, node_id=node, zone=zone, max_skew=max_skew, max_upload=max_upload,
                    host=host, port=port, urls=urls, compress=compress)
    log.info("storage worker %s serving %s on %s:%d", node, data_dir, host, port)
    advertiser = []

    def when_ready(_server: Any) -> None:
        if advertise_on:
            from pipeline.cluster.discovery import Advertiser

            try:
                advertiser.append(Advertiser(node, host, port, zone, advertise_on, key))
            except OSError as exc:  # no multicast here: static lists still find the worker
                log.warning("not advertising on mDNS: %s", exc)

    def on_exit(_server: Any) -> None:
        for a in advertiser:
            a.close()

    def post_fork(_server: Any, _worker: Any) -> None:
        store.reopen()  # a respawned process counts the shards as they are now
        if not is_loopback(host):
            # Other hosts reach it: planes frames will come, and the codec loads now, not inside
            # the first upload (pipeline/service/warmth.py). One on loopback never loads it.
            codec.warm_soon()

    run(app, host=host, port=port, threads=threads, name=f"ckpt-worker-{node}",
        when_ready=when_ready, on_exit=on_exit, post_fork=post_fork)
