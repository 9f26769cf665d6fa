"""The alert webhook (``CKPT_ALERT_WEBHOOK``): the scheduler's alert events, POSTed as JSON.

Each event (an alert fired or resolved, pipeline/alerts.py) is one POST of a JSON object,
signed with the cluster key exactly as a request to a storage worker is (pipeline/cluster/auth.py:
``X-Ckpt-Time``, ``X-Ckpt-Request``, ``X-Ckpt-Body`` the SHA-256 of the body, ``X-Ckpt-Node``
``*``, ``X-Ckpt-Signature`` = hex HMAC-SHA256(key, "POST\\nPATH\\nTIME\\nREQUEST\\nBODY\\n*")), so a
receiver checks it with ``auth.check``. A 2xx answer delivers it; anything else (a 500, a refused
connection, a timeout) is retried with a doubling backoff, each attempt signed anew, up to
:data:`ATTEMPTS` times, then dropped with a log line.

Delivery never blocks the scheduler: :meth:`Notifier.post` only queues the event (a bounded
queue; when it is full the oldest event is dropped), and one daemon thread sends them in order.
Events still queued when the scheduler stops are lost: the banner and the incidents page, read
from the control plane, are the record.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from pipeline.cluster import auth
from pipeline.status import jsonable

log = logging.getLogger("ckpt.webhook")

#: Attempts per event, the first backoff (doubling), its cap, and each attempt's timeout.
ATTEMPTS = 8
BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 60.0
TIMEOUT_SECONDS = 10.0
#: Events waiting to be sent, at most.
QUEUED = 1000


class Notifier:
    """Posts events to ``url`` from a thread of its own, in order, retried with backoff."""

    def __init__(self, url: str, key: bytes, *, attempts: int = ATTEMPTS, backoff: float = BACKOFF_SECONDS,
                 max_backoff: float = MAX_BACKOFF_SECONDS, timeout: float = TIMEOUT_SECONDS) -> None:
        self.url, self.key = url, key
        self.attempts, self.backoff, self.max_backoff, self.timeout = attempts, backoff, max_backoff, timeout
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(QUEUED)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.delivered = 0
        self.dropped = 0

    def post(self, event: dict[str, Any]) -> None:
        """Queue ``event``; returns at once."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-webhook", daemon=True)
                self._thread.start()
            while True:
                try:
                    self._queue.put_nowait(event)
                    return
                except queue.Full:  # the endpoint is far behind: the oldest event goes
                    try:
                        self._queue.get_nowait()
                        self.dropped += 1
                        log.warning("alert webhook: %d events queued, dropping the oldest", QUEUED)
                    except queue.Empty:
                        pass

    def close(self, wait: float = 0.0) -> None:
        """Stop sending (after up to ``wait`` seconds for what is queued)."""
        deadline = time.monotonic() + wait
        while wait and not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.1, deadline - time.monotonic()))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                event = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._deliver(event)
            except Exception as exc:  # the sender thread never dies of one event
                self.dropped += 1
                log.error("alert webhook: could not deliver an event (%s)", type(exc).__name__)

    def _deliver(self, event: dict[str, Any]) -> None:
        body = json.dumps(event, default=jsonable).encode()
        path = urlsplit(self.url).path or "/"
        delay = self.backoff
        for attempt in range(1, self.attempts + 1):
            error = send_once(self.url, path, body, self.key, self.timeout)
            if error is None:
                self.delivered += 1
                return
            if attempt == self.attempts:
                break
            log.warning("alert webhook: attempt %d of %d failed (%s); again in %.1f s", attempt, self.attempts,
                        error, delay)
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, self.max_backoff)
        self.dropped += 1
        log.error("alert webhook: gave up on the %s event of %s after %d attempts", event.get("event"),
                  event.get("alert"), self.attempts)


def send_once(url: str, path: str, body: bytes, key: bytes, timeout: float) -> str | None:
    """One signed POST; None when it was delivered (2xx), else what went wrong."""
    headers = {"Content-Type": "application/json", **auth.sign(key, "POST", path, body)}
    try:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            answer.read()
            return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except Exception as exc:  # a bad URL, a peer that is not HTTP: this attempt failed
        # Never the URL itself: a hook carries its token in it.
        return (str(exc) or type(exc).__name__).replace(url, "<the webhook URL>")
