"""Which storage workers exist, which may receive shards, and which are up.

Workers come from the static list (``CKPT_WORKERS``), from ``ckpt up``, or from mDNS
discovery (recorded as ``candidate``). Every probe is a status request carrying a fresh
nonce: a worker is admitted (``up``) only if it answers with a proof computed from the
cluster key; one that cannot is ``rejected`` and never receives a shard (docs/design.md, invariant 5):
at once if it was never admitted, once it proved nothing for ``worker_down_seconds`` if it was (one
stranger's answer at its URL is no more than a missed probe), never if an operator drains it.
A worker whose disk is above the high watermark is ``full`` (it keeps and serves its
copies, gets no new ones). A worker unseen for ``worker_down_seconds`` is ``down``; one that comes back
(from ``down`` or ``rejected``) is reconciled (pipeline.integrity.reconcile) before its copies count again.
"""
from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.cluster import auth
from pipeline.cluster.client import WorkerClient
from pipeline.db import workers
from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy, StorageWorker
from pipeline.db.transitions import now
from pipeline.errors import UntrustedAnswer, WorkerError
from pipeline.settings import Settings
from pipeline.states import COUNTING_WORKERS, Tier, WorkerState

log = logging.getLogger("ckpt.membership")



@dataclass
class ProbeResult:
    answers: dict[str, str] = field(default_factory=dict)  # url -> node id, or the problem
    returned: list[str] = field(default_factory=list)       # worker ids that came back up
    went_down: list[str] = field(default_factory=list)


def _ask(url: str, key: bytes, timeout: float) -> tuple[str, dict[str, Any] | str, bool]:
    """``(url, status or error, rejected)`` for one worker. Whatever it answers, and however
    malformed, is that worker's problem: this never raises (one bad peer must never keep the
    others' answers from being recorded)."""
    try:
        return _challenge(url, key, timeout)
    except Exception as exc:  # a peer's answer we did not foresee: still only that peer's
        log.exception("probing storage worker %s failed unexpectedly", url)
        return url, f"storage worker {url}: probe failed ({type(exc).__name__}: {exc})", False


def _challenge(url: str, key: bytes, timeout: float) -> tuple[str, dict[str, Any] | str, bool]:
    nonce = secrets.token_hex(16)
    try:
        doc = WorkerClient(url, key, auth.ANY_NODE, timeout=timeout).status(nonce, within=timeout)
    except UntrustedAnswer as exc:  # not signed with the cluster key: a stranger
        return url, str(exc), True
    except WorkerError as exc:
        return url, str(exc), exc.status in (401, 403)
    except ValueError as exc:
        return url, str(exc), False
    node = doc.get("node_id")
    if not isinstance(node, str) or not NODE_ID.fullmatch(node):
        return url, f"answered a malformed node id {str(node)[:40]!r}", True
    if not auth.check_proof(key, node, url, nonce, doc.get("proof")):
        return url, doc, True
    problem = _malformed(doc)
    if problem:
        return url, f"answered a malformed status: {problem}", False
    return url, doc, False


#: What a storage worker's node id looks like (workers/server.py makes "w-" and 12 hex digits).
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _malformed(doc: dict[str, Any]) -> str | None:
    """What is wrong with a proven worker's status answer, or None."""
    for name in ("capacity", "free"):
        if type(doc.get(name)) is not int or doc[name] < 0:
            return f"{name!r} is not a byte count"
    if type(doc.get("used", 0)) is not int or doc.get("used", 0) < 0:
        return "'used' is not a byte count"
    if not isinstance(doc.get("zone", ""), str) or len(doc.get("zone", "")) > 64:
        return "'zone' is not a short text"
    fs = doc.get("filesystem")
    if fs is not None and not (isinstance(fs, dict) and isinstance(fs.get("id"), str) and 0 < len(fs["id"]) <= 255
                               and all(type(fs.get(k)) is int and fs[k] >= 0 for k in ("capacity", "free"))):
        return "'filesystem' is not an id with a capacity and free bytes"
    return None


def is_full(capacity: int, free: int, high_watermark: float) -> bool:
    """Whether a worker is above the high watermark: it gets no new copies, keeps its own."""
    return capacity > 0 and (capacity - free) >= high_watermark * capacity


def probe_all(settings: Settings, extra_urls: tuple[str, ...] = (), *,
              only: tuple[str, ...] | None = None) -> ProbeResult:
    """Challenge every known worker (or ``only`` these URLs) and record what it proved."""
    with session_scope(settings.db_url) as s:
        recorded = s.scalars(select(StorageWorker).where(StorageWorker.state != WorkerState.REMOVABLE,
                                                         StorageWorker.tier == Tier.WORKERS))
        known = {w.url: w.source for w in recorded}
    urls = {u.rstrip("/"): "static" for u in (*settings.workers, *extra_urls)}
    for url, source in known.items():
        urls.setdefault(url, source)
    if only is not None:
        urls = {u.rstrip("/"): urls.get(u.rstrip("/"), "static") for u in only}
    answers = _gather(list(urls), settings.key(), settings.probe_seconds)
    result = ProbeResult()
    t = now()
    with session_scope(settings.db_url) as s:
        for url, answer, rejected in answers:
            try:
                with s.begin_nested():  # one worker's bad answer spoils nothing else
                    _record(s, settings, url, answer, rejected, urls[url], t, result)
            except Exception as exc:
                log.exception("recording what storage worker %s answered failed", url)
                result.answers[url] = f"could not record its answer: {exc}"
    return result


#: How long past a probe's own deadline its answer is waited for (the thread's start, its end).
GRACE_SECONDS = 1.0


def _gather(urls: list[str], key: bytes, seconds: float) -> list[tuple[str, dict[str, Any] | str, bool]]:
    """Every worker's answer (:func:`_ask`), asked all at once. Each exchange ends by itself
    within ``seconds`` (WorkerClient.status's deadline); a thread still not done a moment later
    is not waited for: its peer is recorded as not answering in time and the thread, a daemon
    nobody joins, ends when it ends (it keeps neither the others' answers nor a shutdown waiting)."""
    futures: dict[str, Future[tuple[str, dict[str, Any] | str, bool]]] = {}
    for url in urls:
        future: Future[tuple[str, dict[str, Any] | str, bool]] = Future()
        futures[url] = future
        threading.Thread(target=lambda u=url, f=future: f.set_result(_ask(u, key, seconds)),
                         name=f"probe {url}", daemon=True).start()
    done, _late = wait(futures.values(), timeout=seconds + GRACE_SECONDS)
    return [f.result() if f in done else (url, f"storage worker {url}: no full answer within {seconds:g} s", False)
            for url, f in futures.items()]


def _record(s: Session, settings: Settings, url: str, answer: dict[str, Any] | str, rejected: bool,
            source: str, t: datetime, result: ProbeResult) -> None:
    """Record what the worker at ``url`` answered to one probe."""
    rows: list[StorageWorker] = list(s.scalars(select(StorageWorker).where(StorageWorker.url == url)))
    if rejected:
        reason = "failed the cluster-key challenge: it does not hold the cluster key"
        result.answers[url] = reason
        if not rows and source != "mdns":
            # Never under the id it claims: a stranger must not take (or block) a real
            # worker's row. hash() is salted per process: a stable id comes from the URL's SHA-256.
            stable = "unknown-" + hashlib.sha256(url.encode()).hexdigest()[:12]
            rows = [s.get(StorageWorker, stable) or workers.add(s, stable, url, source=source)]
        for w in rows:
            holds = s.scalar(select(ContentCopy.id).where(ContentCopy.worker_id == w.id).limit(1))
            if w.source == "mdns" and holds is None:
                # A stranger found on the LAN: forgotten, not listed (a static one stays listed,
                # rejected, since an operator named it and wants to know why).
                log.info("forgetting %s at %s, found on mDNS: %s", w.id, url, reason)
                s.delete(w)
                continue
            if w.state in COUNTING_WORKERS and not _silent(settings, w, t):
                # One stranger's answer at its URL (another service bound the port during a
                # restart) is no more evidence its copies are gone than one missed probe: they
                # count until it proves nothing for worker_down_seconds, as for 'down'.
                w.last_error = reason
                continue
            if workers.may(w, WorkerState.REJECTED) and w.state != WorkerState.REJECTED:
                log.warning("storage worker %s at %s rejected: %s", w.id, url, reason)
                if w.state in COUNTING_WORKERS:
                    result.went_down.append(w.id)
            workers.observe(s, w, WorkerState.REJECTED, error=reason)  # an operator's drain stays
        return
    if isinstance(answer, dict):
        node = str(answer["node_id"])
        found = s.get(StorageWorker, node)
        if found is None:
            found = workers.add(s, node, url, source=source)
        w = found
        for other in rows:  # recorded at this URL under another name
            if other.id == node:
                continue
            holds = s.scalar(select(ContentCopy.id).where(ContentCopy.worker_id == other.id).limit(1))
            if other.state in (WorkerState.CANDIDATE, WorkerState.REJECTED) and holds is None:
                s.delete(other)  # an mDNS candidate, a stranger that held nothing
            elif other.state not in (WorkerState.REJECTED, WorkerState.REMOVABLE):
                # Another node now answers at its URL: its copies are not here to count (a
                # draining one stays draining: WORKER_MOVES; its answers are signed by its own node).
                workers.observe(s, other, WorkerState.DOWN, error=f"{node} answers at {url} now")
                result.went_down.append(other.id)
        w.capacity_bytes, w.free_bytes = int(answer["capacity"]), int(answer["free"])
        w.used_bytes = int(answer.get("used", 0))
        fs = answer.get("filesystem")  # an older worker does not say: counted alone
        w.filesystem, w.fs_capacity_bytes, w.fs_free_bytes = (
            (fs["id"], int(fs["capacity"]), int(fs["free"])) if fs else (None, None, None))
        live = WorkerState.FULL if is_full(w.capacity_bytes, w.free_bytes, settings.high_watermark) else WorkerState.UP
        if workers.may(w, live):  # never out of an operator's draining or removable
            if w.state in (WorkerState.DOWN, WorkerState.REJECTED):  # its copies count again once reconciled
                result.returned.append(node)
            if w.state not in (WorkerState.UP, WorkerState.FULL):
                log.info("storage worker %s at %s admitted (%s)", node, url, w.source)
            elif w.state != live:
                log.warning("storage worker %s is %s: %s of %s bytes free (high watermark %.0f%%)",
                            node, live, f"{w.free_bytes:,}", f"{w.capacity_bytes:,}",
                            100 * settings.high_watermark)
            workers.set_state(s, w, live)
        w.url, w.zone, w.last_seen, w.last_error = url, answer.get("zone", ""), t, None
        result.answers[url] = node
        return
    result.answers[url] = answer
    for w in rows:
        w.last_error = answer
        if w.state in COUNTING_WORKERS and _silent(settings, w, t):
            workers.set_state(s, w, WorkerState.DOWN)
            result.went_down.append(w.id)
            log.warning("storage worker %s at %s is down: %s", w.id, url, answer)


def _silent(settings: Settings, w: StorageWorker, t: datetime) -> bool:
    """Whether ``w`` proved nothing for ``worker_down_seconds``."""
    return w.last_seen is None or t - w.last_seen > timedelta(seconds=settings.worker_down_seconds)


def answers_as(settings: Settings, url: str, node_id: str, timeout: float = 5.0) -> bool:
    """Whether the worker ``node_id`` answers at ``url`` now, proving the cluster key (one probe,
    recorded nowhere): a worker about to be forgotten that would be found again."""
    _url, answer, rejected = _ask(url, settings.key(), min(timeout, settings.probe_seconds))
    return not rejected and isinstance(answer, dict) and answer.get("node_id") == node_id
