"""Which storage workers exist and which are up: probing and recording them.

Workers come from the static list (``CKPT_WORKERS``) or were recorded earlier (by
``ckpt up`` or discovery). Each probe is an authenticated ``GET /v1/status``: a worker
that answers is up; one unseen for ``worker_down_seconds`` is down and stops counting.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import StorageWorker
from pipeline.db.transitions import now
from pipeline.errors import WorkerError
from pipeline.settings import Settings
from pipeline.worker_client import WorkerClient

log = logging.getLogger("ckpt.membership")


def probe_all(settings: Settings, extra_urls: tuple[str, ...] = ()) -> dict[str, str]:
    """Probe every known worker; record what answered; return {url: node id or error}."""
    with session_scope(settings.db_url) as s:
        known = {w.url: w.source for w in s.scalars(select(StorageWorker))}
    urls = {u.rstrip("/"): "static" for u in (*settings.workers, *extra_urls)}
    for url, source in known.items():
        urls.setdefault(url, source)
    key = settings.key()

    def ask(url: str) -> tuple[str, dict[str, Any] | str]:
        try:
            return url, WorkerClient(url, key, timeout=10).status()
        except (WorkerError, ValueError) as exc:
            return url, str(exc)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        answers = dict(pool.map(ask, urls))
    out: dict[str, str] = {}
    t = now()
    with session_scope(settings.db_url) as s:
        for url, answer in answers.items():
            if isinstance(answer, dict):
                node = str(answer["node_id"])
                w = s.get(StorageWorker, node)
                if w is None:
                    w = StorageWorker(id=node, url=url, source=urls[url])
                    s.add(w)
                    log.info("storage worker %s at %s joined", node, url)
                elif w.state != "up":
                    log.info("storage worker %s at %s is up", node, url)
                w.url, w.zone, w.state, w.last_seen, w.last_error = url, answer.get("zone", ""), "up", t, None
                w.capacity_bytes, w.free_bytes = int(answer["capacity"]), int(answer["free"])
                out[url] = node
            else:
                out[url] = answer
                for w in s.scalars(select(StorageWorker).where(StorageWorker.url == url)):
                    w.last_error = answer
                    silent = w.last_seen is None or t - w.last_seen > timedelta(seconds=settings.worker_down_seconds)
                    if w.state == "up" and silent:
                        w.state = "down"
                        log.warning("storage worker %s at %s is down: %s", w.id, url, answer)
    return out
