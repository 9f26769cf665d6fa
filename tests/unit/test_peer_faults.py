"""Every wrong answer is the peer's error, never ours: real sockets on 127.0.0.1 answering
like another service (SSH), garbage, silence, HTTP with a body that is not JSON, an answer cut
short; key holders answering the wrong shape. Each call raises WorkerError for that peer (or,
probing, records it as that peer's answer), and nothing else escapes."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest

from pipeline.cluster import membership
from pipeline.cluster.client import WorkerClient
from pipeline.cluster.faults import Stalled, send_all
from pipeline.db.migrate import upgrade
from pipeline.errors import WorkerError
from tests.bad_peers import KINDS, _head, bad_peer, serving, signed

KEY = b"peer-faults-key"
SHA = "ab" * 32
NODE = "w-000000000001"


@pytest.mark.parametrize("kind", KINDS)
def test_a_probe_of_a_bad_peer_is_recorded_as_that_peers_error_and_never_raises(kind):
    with bad_peer(kind) as url:
        got, answer, _rejected = membership._ask(url, KEY, 0.5)
    assert got == url
    assert isinstance(answer, str) and url in answer, answer


def test_a_peer_answering_ssh_is_told_apart_from_one_that_is_down():
    with bad_peer("ssh") as url:
        answer = membership._ask(url, KEY, 0.5)[1]
    assert "not HTTP" in str(answer) and "SSH-2.0" in str(answer)


def _put(client: WorkerClient, tmp_path) -> object:
    f = tmp_path / "blob"
    f.write_bytes(b"x" * 300_000)
    return client.put_range(SHA, b"", str(f), 0, 300_000, chain=[("w-2", "http://127.0.0.1:1")])


def _open(client: WorkerClient, _tmp) -> object:
    conn, resp = client.open_shard(SHA)
    try:
        return resp.read()
    finally:
        conn.close()


CALLS = {
    "status": lambda c, _t: c.status("nonce"),
    "head": lambda c, _t: c.head(SHA),
    "verify": lambda c, _t: c.verify([SHA]),
    "stat": lambda c, _t: c.stat([SHA]),
    "delete_many": lambda c, _t: c.delete_many([SHA]),
    "inventory_page": lambda c, _t: c.inventory_page(),
    "put_range": _put,
    "open_shard": _open,
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("kind", KINDS)
def test_every_call_to_a_bad_peer_raises_that_workers_error(kind, call, tmp_path):
    with bad_peer(kind) as url:
        with pytest.raises(WorkerError) as caught:
            CALLS[call](WorkerClient(url, KEY, NODE, timeout=0.5), tmp_path)
    assert caught.value.worker == url


@pytest.mark.parametrize(("call", "body"), [
    ("verify", b'{"results": "all good"}'),
    ("verify", b'{"results": [{"name": "' + b"cd" * 32 + b'", "sha256": null}]}'),  # another shard
    ("verify", b'{"results": []}'),
    ("stat", b"<html>not json</html>"),
    ("stat", b"[1, 2, 3]"),
    ("delete_many", b'{"deleted": 3}'),
    ("inventory_page", b'{"shards": [["a"], 7]}'),
    ("status", b'{"node_id": "' + NODE.encode() + b'"'),
    ("head", b""),
    ("put_range", b"[]"),
])
def test_a_key_holders_answer_of_the_wrong_shape_is_that_workers_error(call, body, tmp_path):
    status = 201 if call == "put_range" else 200
    # a HEAD answer whose length is no number
    answer = signed(KEY, NODE, 200, b"", length="lots") if call == "head" else signed(KEY, NODE, status, body)
    with serving(answer) as url:
        with pytest.raises(WorkerError) as caught:
            CALLS[call](WorkerClient(url, KEY, NODE, timeout=0.5), tmp_path)
    assert caught.value.worker == url


def _sink(conn: socket.socket, stop: threading.Event) -> None:
    """A target that takes every byte and never answers."""
    while conn.recv(1 << 20):
        pass


@pytest.mark.parametrize("hold", [True, False], ids=["source stalls", "source cuts the stream"])
def test_a_copy_whose_source_fails_midway_blames_the_source_not_the_target(hold):
    source = signed(KEY, NODE, 200, b"", length=1 << 20, send=b"y" * 4096, hold=hold)
    with serving(source) as src_url, serving(_sink) as dst_url:
        target = WorkerClient(dst_url, KEY, "w-target", timeout=5)
        with pytest.raises(WorkerError) as caught:
            target.copy_from(WorkerClient(src_url, KEY, NODE, timeout=0.3), SHA, 1 << 20)
    assert caught.value.worker == src_url
    assert ("no byte moved for 0.3 s" if hold else "cut short") in caught.value.reason


def _pair(buffer: int) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    return a, b


def test_a_link_that_stops_taking_bytes_fails_after_the_stall_timeout():
    sender, receiver = _pair(16 * 1024)
    try:
        sender.settimeout(0.2)
        with pytest.raises(Stalled, match="no byte moved for 0.2 s"):
            send_all(sender, b"z" * (4 << 20))
    finally:
        sender.close()
        receiver.close()


def test_a_slow_link_that_keeps_moving_is_never_cut():
    """The transfer lasts longer than the stall timeout in all, but no gap is near it: a
    deadline on the whole transfer (``socket.sendall``'s) would cut it."""
    sender, receiver = _pair(16 * 1024)
    size, got = 2_500_000, []

    def slow_reader() -> None:
        n = 0
        while n < size:
            chunk = receiver.recv(32 * 1024)
            if not chunk:
                return
            n += len(chunk)
            time.sleep(0.02)  # about 1.6 MB/s: a gap 50 times shorter than the timeout
        got.append(n)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    try:
        sender.settimeout(1.0)
        started = time.monotonic()
        send_all(sender, b"s" * size)
        reader.join(30)
        assert got == [size]
        assert time.monotonic() - started > 1.0  # it did outlast the timeout
    finally:
        sender.close()
        receiver.close()
        reader.join(30)


# -- a probe's answer: bounded in time and size, whatever the peer does -----------------------

def _drip(conn: socket.socket, stop: threading.Event) -> None:
    """An HTTP answer that never ends: one byte of its declared body every 0.2 s, so no
    single receive ever waits as long as the probe's timeout."""
    _head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"x")


def _drip_head(conn: socket.socket, stop: threading.Event) -> None:
    """The same, one byte of a header line at a time."""
    _head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not stop.wait(0.2):
        conn.sendall(b"x")


def _endless(conn: socket.socket, stop: threading.Event) -> None:
    """A body with no length that never ends, sent as fast as it is taken."""
    _head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    chunk = b"y" * 65536
    while not stop.is_set():
        conn.sendall(chunk)


def _huge(conn: socket.socket, stop: threading.Event) -> None:
    """A declared length no status answer has."""
    _head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n" + b"z" * 4096)
    stop.wait()


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
    assert "no full answer within 0.5 s" in done[0].answers[url], done[0].answers
    assert "cannot connect" in done[0].answers["http://127.0.0.1:1"], done[0].answers


@pytest.mark.parametrize("peer", [_drip, _drip_head], ids=["body", "head"])
def test_a_status_exchange_ends_at_its_deadline_however_its_bytes_trickle(peer):
    with serving(peer) as url:
        started = time.monotonic()
        with pytest.raises(WorkerError, match="no full answer within 0.6 s") as caught:
            WorkerClient(url, KEY, NODE, timeout=5).status("nonce", within=0.6)
        took = time.monotonic() - started
    assert caught.value.worker == url
    assert took < 2, f"the exchange took {took:.1f} s with a 0.6 s deadline"


@pytest.mark.parametrize("peer", [_endless, _huge], ids=["endless", "declared"])
def test_a_status_answer_larger_than_any_workers_is_refused_unread(peer):
    """A status answer is a few hundred bytes: one that goes on (or says it will) for more than
    STATUS_MAX_BYTES is refused once that much came, never read whole into memory."""
    with serving(peer) as url:
        with pytest.raises(WorkerError, match="more than the 1,048,576 bytes") as caught:
            WorkerClient(url, KEY, NODE, timeout=5).status("nonce", within=30)
    assert caught.value.worker == url


def test_a_probe_thread_stuck_past_its_deadline_is_not_waited_for(settings, monkeypatch):
    """Should an exchange outlive its own deadline anyway, probe_all records that peer as not
    answering in time and every other one as it answered, without waiting for it."""
    upgrade(settings.db_url)
    release = threading.Event()
    real = membership._ask

    def ask(url, key, timeout):
        if url.endswith(":2"):
            release.wait(30)
        return real(url, key, timeout)

    monkeypatch.setattr(membership, "_ask", ask)
    s = dataclasses.replace(settings, probe_seconds=0.3, workers=("http://127.0.0.1:1", "http://127.0.0.1:2"))
    try:
        started = time.monotonic()
        result = membership.probe_all(s)
        took = time.monotonic() - started
    finally:
        release.set()
    assert took < 0.3 + membership.GRACE_SECONDS + 1, took
    assert result.answers["http://127.0.0.1:2"] == "storage worker http://127.0.0.1:2: no full answer within 0.3 s"
    assert "cannot connect" in result.answers["http://127.0.0.1:1"], result.answers
