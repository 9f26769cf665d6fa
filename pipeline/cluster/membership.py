"""Which storage workers exist, which may receive shards, and which are up.

Workers come from the static list (``CKPT_WORKERS``), from ``ckpt up``, or from mDNS
discovery (recorded as ``candidate``). Every probe is a status request carrying a fresh
nonce: a worker is admitted (``up``) only if it answers with a proof computed from the
cluster key; one that cannot is ``rejected`` and never receives a shard (docs/design.md, invariant 5).
A worker whose disk is above the high watermark is ``full`` (it keeps and serves its
copies, gets no new ones). A worker unseen for ``worker_down_seconds`` is ``down``; one that comes back is
reconciled (pipeline.integrity.reconcile) before its copies count again.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from pipeline.cluster import auth
from pipeline.cluster.client import WorkerClient
from pipeline.db.engine import session_scope
from pipeline.db.models import StorageWorker
from pipeline.db.transitions import now
from pipeline.errors import WorkerError
from pipeline.settings import Settings
from pipeline.states import STICKY_WORKERS, WorkerState

log = logging.getLogger("ckpt.membership")



@dataclass
class ProbeResult:
    answers: dict[str, str] = field(default_factory=dict)  # url -> node id, or the problem
    returned: list[str] = field(default_factory=list)       # worker ids that came back up
    went_down: list[str] = field(default_factory=list)


def _ask(url: str, key: bytes) -> tuple[str, dict[str, Any] | str, bool]:
    """``(url, status or error, rejected)`` for one worker."""
    nonce = secrets.token_hex(16)
    try:
        doc = WorkerClient(url, key, timeout=10).status(nonce)
    except WorkerError as exc:
        return url, str(exc), exc.status in (401, 403)
    except ValueError as exc:
        return url, str(exc), False
    if not auth.check_proof(key, str(doc.get("node_id")), nonce, doc.get("proof")):
        return url, doc, True
    return url, doc, False


def is_full(capacity: int, free: int, high_watermark: float) -> bool:
    """Whether a worker is above the high watermark: it gets no new copies, keeps its own."""
    return capacity > 0 and (capacity - free) >= high_watermark * capacity


def probe_all(settings: Settings, extra_urls: tuple[str, ...] = ()) -> ProbeResult:
    """Challenge every known worker and record what it proved."""
    with session_scope(settings.db_url) as s:
        recorded = s.scalars(select(StorageWorker).where(StorageWorker.state != WorkerState.REMOVABLE))
        known = {w.url: w.source for w in recorded}
    urls = {u.rstrip("/"): "static" for u in (*settings.workers, *extra_urls)}
    for url, source in known.items():
        urls.setdefault(url, source)
    key = settings.key()
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        answers = list(pool.map(lambda u: _ask(u, key), urls))
    result = ProbeResult()
    t = now()
    with session_scope(settings.db_url) as s:
        for url, answer, rejected in answers:
            rows: list[StorageWorker] = list(s.scalars(select(StorageWorker).where(StorageWorker.url == url)))
            if rejected:
                reason = "failed the cluster-key challenge: it does not hold the cluster key"
                result.answers[url] = reason
                if not rows:
                    node = answer.get("node_id") if isinstance(answer, dict) else None
                    # hash() is salted per process: a stable id comes from the URL's SHA-256.
                    stable = "unknown-" + hashlib.sha256(url.encode()).hexdigest()[:12]
                    rows = [StorageWorker(id=str(node or stable), url=url, source=urls[url])]
                    s.add(rows[0])
                for w in rows:
                    if w.state != WorkerState.REJECTED:
                        log.warning("storage worker %s at %s rejected: %s", w.id, url, reason)
                    w.state, w.last_error = WorkerState.REJECTED, reason
                continue
            if isinstance(answer, dict):
                node = str(answer["node_id"])
                found = s.get(StorageWorker, node)
                if found is None:
                    found = StorageWorker(id=node, url=url, source=urls[url], state=WorkerState.CANDIDATE)
                    s.add(found)
                w = found
                for other in rows:  # an mDNS candidate recorded under another name
                    if other.id != node and other.state in (WorkerState.CANDIDATE, WorkerState.REJECTED):
                        s.delete(other)
                w.capacity_bytes, w.free_bytes = int(answer["capacity"]), int(answer["free"])
                w.used_bytes = int(answer.get("used", 0))
                if w.state not in STICKY_WORKERS:
                    full = is_full(w.capacity_bytes, w.free_bytes, settings.high_watermark)
                    live = WorkerState.FULL if full else WorkerState.UP
                    if w.state == WorkerState.DOWN:
                        result.returned.append(node)
                    if w.state not in (WorkerState.UP, WorkerState.FULL):
                        log.info("storage worker %s at %s admitted (%s)", node, url, w.source)
                    elif w.state != live:
                        log.warning("storage worker %s is %s: %s of %s bytes free (high watermark %.0f%%)",
                                    node, live, f"{w.free_bytes:,}", f"{w.capacity_bytes:,}",
                                    100 * settings.high_watermark)
                    w.state = live
                w.url, w.zone, w.last_seen, w.last_error = url, answer.get("zone", ""), t, None
                result.answers[url] = node
                continue
            result.answers[url] = answer
            for w in rows:
                w.last_error = answer
                silent = w.last_seen is None or t - w.last_seen > timedelta(seconds=settings.worker_down_seconds)
                if w.state in (WorkerState.UP, WorkerState.FULL) and silent:
                    w.state = WorkerState.DOWN
                    result.went_down.append(w.id)
                    log.warning("storage worker %s at %s is down: %s", w.id, url, answer)
    return result
