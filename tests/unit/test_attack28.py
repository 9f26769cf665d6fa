"""Attack on issue 28 ("never wedged"): orders of events and peer answers no other test names."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time

from pipeline.cluster import membership
from pipeline.db.migrate import upgrade
from tests.bad_peers import _head, serving


def _drip(conn: socket.socket, stop: threading.Event) -> None:
    """An HTTP answer that never ends: one byte of its declared body every 0.2 s, so no
    single receive ever waits as long as the probe's timeout."""
    _head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"x")


def test_a_peer_that_drips_its_answer_does_not_hold_up_the_probe_of_every_worker(settings):
    """CKPT_PROBE_SECONDS bounds each receive, not the exchange: a stranger on a worker's port
    that drips a byte every 0.2 s keeps probe_all (and with it the scheduler's whole tick:
    re-drives, rotation, repair) from returning, and no other worker's answer is recorded."""
    upgrade(settings.db_url)
    with serving(_drip) as url:
        s = dataclasses.replace(settings, probe_seconds=0.5, workers=(url, "http://127.0.0.1:1"))
        done: list[membership.ProbeResult] = []
        t = threading.Thread(target=lambda: done.append(membership.probe_all(s)), daemon=True)
        started = time.monotonic()
        t.start()
        t.join(6)
        took = time.monotonic() - started
    t.join(30)
    assert took < 6, f"probe_all took {took:.1f} s with CKPT_PROBE_SECONDS=0.5: one dripping peer wedged it"
