"""What a probe's answer does to a worker's row: a stranger answering once at a worker's URL
(another service bound its port during a restart) neither undoes an operator's drain nor drops
a live worker's copies from the count, and a worker back from ``rejected`` is reconciled before
its copies count again, like one back from ``down``."""
from __future__ import annotations

import dataclasses
import json
import socket
import threading
from datetime import timedelta

import pytest

from pipeline.cluster import auth, membership
from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import StorageWorker
from pipeline.db.transitions import now
from tests.bad_peers import _head, request_id, serving

NODE = "w-00000000000d"
STRANGER = "failed the cluster-key challenge: it does not hold the cluster key"


def _header(head: bytes, name: str) -> str:
    for line in head.split(b"\r\n"):
        k, _, v = line.partition(b":")
        if k.strip().lower() == name.lower().encode():
            return v.strip().decode()
    return ""


def _stranger_then_genuine(settings, start: str, *, silent_for: float = 0.0):
    """A worker row in ``start``, last seen ``silent_for`` seconds ago; one probe answered 403
    by a stranger at its URL, then one answered by the real worker: the worker's (state, last
    error) after each, and the two probes' results."""
    upgrade(settings.db_url)
    key = settings.key()
    mode = ["stranger"]

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        head = _head(conn)
        if mode[0] == "stranger":
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        doc = {"node_id": NODE, "capacity": 10**12, "free": 10**12, "used": 0,
               "proof": auth.proof(key, NODE, _header(head, auth.URL_HEADER), _header(head, auth.NONCE_HEADER))}
        body = json.dumps(doc).encode()
        headers = auth.sign_response(key, NODE, request_id(head), 200, auth.body_digest(body))
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n".encode()
                     + "".join(f"{k}: {v}\r\n" for k, v in headers).encode() + b"\r\n" + body)

    def row() -> tuple[str, str | None]:
        with session_scope(settings.db_url, readonly=True) as s:
            w = s.get(StorageWorker, NODE)
            return w.state, w.last_error

    with serving(answer) as url:
        s = dataclasses.replace(settings, workers=(url,))  # a removable worker is probed only if listed
        with session_scope(s.db_url) as ses:
            ses.add(StorageWorker(id=NODE, url=url, source="static", state=start,
                                  last_seen=now() - timedelta(seconds=silent_for)))
        first = membership.probe_all(s)
        after_stranger = row()
        mode[0] = "genuine"
        back = membership.probe_all(s)
    return after_stranger, row(), first, back


@pytest.mark.parametrize("start", ["draining", "removable"])
def test_one_stranger_answer_at_a_draining_workers_url_cancels_the_drain(settings, start):
    """A draining worker (an operator's decision, which a probe never overrides) whose port
    answers one probe with a 403 became 'rejected'; the next probe of the real worker admitted
    it 'up' from there: the drain was gone, the worker took new copies, and nothing said so.
    Same from 'removable'."""
    after_stranger, final, _first, back = _stranger_then_genuine(settings, start, silent_for=3600)
    assert after_stranger == (start, STRANGER), "the stranger's answer is recorded as the error, nothing more"
    assert final == (start, None), f"the operator's {start} became {final[0]!r} after one stranger answer"
    assert back.returned == []


def test_one_stranger_answer_at_an_up_workers_url_keeps_its_copies_counted(settings):
    """An up worker answered for once by a stranger is not yet 'rejected' (its copies would stop
    counting, and repairs start, at once): like a missed probe, it has worker_down_seconds."""
    after_stranger, final, first, back = _stranger_then_genuine(settings, "up")
    assert after_stranger == ("up", STRANGER)
    assert first.went_down == []
    assert final == ("up", None)
    assert back.returned == [], "its copies never stopped counting: nothing to reconcile"


def test_a_worker_back_from_rejected_is_reconciled_before_its_copies_count(settings):
    """'up' -> 'rejected' (a stranger answers where it proved nothing for worker_down_seconds)
    -> 'up': its copies, uncounted meanwhile, counted again at once; unlike a return from
    'down', no reconcile was asked (ProbeResult.returned named only workers that were 'down')."""
    silent = settings.worker_down_seconds + 60
    after_stranger, final, first, back = _stranger_then_genuine(settings, "up", silent_for=silent)
    assert after_stranger == ("rejected", STRANGER)
    assert first.went_down == [NODE], "its copies stopped counting: the scheduler's sweep should run"
    assert final == ("up", None)
    assert back.returned == [NODE], "came back from rejected without a reconcile"
