"""Every wrong answer is the peer's error, never ours: real sockets on 127.0.0.1 answering
like another service (SSH), garbage, silence, HTTP with a body that is not JSON, an answer cut
short; key holders answering the wrong shape. Each call raises WorkerError for that peer (or,
probing, records it as that peer's answer), and nothing else escapes."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from pipeline.cluster import membership
from pipeline.cluster.client import WorkerClient
from pipeline.cluster.faults import Stalled, send_all
from pipeline.errors import WorkerError
from tests.bad_peers import KINDS, bad_peer, serving, signed

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
