"""The alert webhook (pipeline/webhook.py) against a real HTTP server on 127.0.0.1: every POST is
signed with the cluster key the way worker requests are, a 500 is retried (signed anew), the
events arrive in order, and a dead endpoint never slows the scheduler's evaluation."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import socket
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import update

from pipeline.cluster import auth
from pipeline.db.engine import session_scope
from pipeline.db.models import StorageWorker
from pipeline.db.transitions import now
from pipeline.errors import AuthError
from pipeline.service.scheduler import Scheduler
from pipeline.webhook import Notifier
from tests.processes import wait_for
from tests.unit.test_alerts import run_dir  # noqa: F401  (the seeded run's directory)
from tests.webui.conftest import seed

KEY = b"test-key"


@contextlib.contextmanager
def receiver(answers: list[int]):
    """An HTTP server on loopback that answers each POST with the next status of ``answers``
    (then 200) and records (status, path, headers, body) of every request."""
    seen: list[tuple[int, str, dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status = answers.pop(0) if answers else 200
            seen.append((status, self.path, dict(self.headers.items()), body))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hooks/ckpt", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def check_signed(path: str, headers: dict[str, str], body: bytes, key: bytes = KEY) -> None:
    """What a receiver does: the worker's own check, and the body against its signed digest."""
    digest = auth.check(key, "POST", path, {h: headers.get(h) for h in auth.SIGNED_HEADERS}, 300,
                        node_id="*", any_node=True)
    assert digest == hashlib.sha256(body).hexdigest()


def test_events_are_signed_retried_after_a_500_and_delivered_in_order():
    with receiver([500]) as (url, seen):
        notifier = Notifier(url, KEY, backoff=0.05)
        try:
            notifier.post({"event": "fired", "alert": "worker_down", "subject": "w-1", "since": now()})
            notifier.post({"event": "resolved", "alert": "worker_down", "subject": "w-1"})
            wait_for(lambda: notifier.delivered == 2, 10, "both events delivered")
        finally:
            notifier.close()
    assert [s for s, *_ in seen] == [500, 200, 200]
    events = [json.loads(body) for *_, body in seen]
    assert [e["event"] for e in events] == ["fired", "fired", "resolved"]  # the 500'd event again, then the next
    assert events[0]["since"].endswith("Z")  # times as ISO 8601 UTC
    for _status, path, headers, body in seen:
        assert path == "/hooks/ckpt" and headers["Content-Type"] == "application/json"
        check_signed(path, headers, body)
        with pytest.raises(AuthError):
            check_signed(path, headers, body, key=b"another-key")
    assert len({h[auth.REQUEST_HEADER] for _s, _p, h, _b in seen}) == 3  # each attempt signed anew


def test_an_event_is_dropped_after_its_attempts_and_the_next_still_goes():
    with receiver([500, 500, 500]) as (url, seen):
        notifier = Notifier(url, KEY, attempts=3, backoff=0.01)
        try:
            notifier.post({"event": "fired", "alert": "dead_letters"})
            notifier.post({"event": "resolved", "alert": "dead_letters"})
            wait_for(lambda: notifier.delivered == 1, 10, "the second event delivered")
        finally:
            notifier.close()
    assert notifier.dropped == 1 and [s for s, *_ in seen] == [500, 500, 500, 200]


def test_a_dead_endpoint_never_slows_the_schedulers_evaluation(db):
    """An endpoint that accepts connections and never answers: evaluating alerts (which posts
    the events) returns at once; the sender thread alone waits."""
    seed(db)
    with session_scope(db.db_url) as s:
        s.execute(update(StorageWorker).where(StorageWorker.id == "w-1")
                  .values(state="down", last_seen=now() - timedelta(hours=1)))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nobody reads or answers
    try:
        s = dataclasses.replace(db, alert_webhook=f"http://127.0.0.1:{silent.getsockname()[1]}/hook")
        sched = Scheduler(s, lambda sends: None)
        assert sched.notifier is not None
        sched.notifier.timeout = 30.0
        start = time.monotonic()
        sched.evaluate_alerts()
        took = time.monotonic() - start
        assert sched.notifier.delivered == 0  # the event waits on the sender's thread
        assert took < 2.0, f"evaluating alerts took {took:.1f} s with a dead webhook"
        sched.notifier.close()
    finally:
        silent.close()


def test_the_scheduler_posts_what_fires_to_the_webhook(db):
    seed(db)
    with session_scope(db.db_url) as s:
        s.execute(update(StorageWorker).where(StorageWorker.id == "w-1")
                  .values(state="down", last_seen=now() - timedelta(hours=1)))
    with receiver([]) as (url, seen):
        sched = Scheduler(dataclasses.replace(db, alert_webhook=url), lambda sends: None)
        try:
            sched.evaluate_alerts()
            wait_for(lambda: any(json.loads(b)["alert"] == "worker_down" for *_, b in seen), 10, "the event")
        finally:
            assert sched.notifier is not None
            sched.notifier.close()
    event = next(json.loads(b) for *_, b in seen if json.loads(b)["alert"] == "worker_down")
    assert event["event"] == "fired" and event["subject"] == "w-1" and event["severity"] == "warning"
    check_signed(seen[0][1], seen[0][2], seen[0][3])
