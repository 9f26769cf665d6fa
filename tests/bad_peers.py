"""Peers that answer wrongly, on real sockets on 127.0.0.1: another service on a worker's port,
garbage, silence, a body that is not JSON, an answer cut short, a stream that stalls. Each is
a thread serving until the context ends."""
from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections.abc import Callable, Iterator

from pipeline.cluster import auth

#: What each kind of bad peer does once it has read the request's head.
KINDS = ("ssh", "garbage", "silent", "not_json", "cut")


def _head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def request_id(head: bytes) -> str:
    """The signed request id in a request's head (to sign an answer as a key holder would)."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == auth.REQUEST_HEADER.lower().encode():
            return value.strip().decode()
    return ""


def _answer(kind: str, conn: socket.socket, stop: threading.Event) -> None:
    if kind == "silent":  # accepts, reads nothing, answers nothing
        stop.wait()
        return
    _head(conn)
    if kind == "ssh":
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    elif kind == "garbage":
        conn.sendall(random.Random(28).randbytes(4096))
    elif kind == "not_json":
        body = b"<html><body>It works!</body></html>"
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    elif kind == "cut":
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
    else:
        raise ValueError(kind)


@contextlib.contextmanager
def serving(answer: Callable[[socket.socket, threading.Event], None],
            port: int = 0) -> Iterator[str]:
    """A TCP server on 127.0.0.1 (``port``, or a free one) calling ``answer`` per connection
    in its own thread; its URL. Every connection is closed when the context ends."""
    server = socket.create_server(("127.0.0.1", port))
    stop = threading.Event()
    conns: list[socket.socket] = []

    def handle(conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            answer(conn, stop)
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        with contextlib.suppress(OSError):  # wakes the accept (closing the socket does not)
            socket.create_connection(server.getsockname(), timeout=1).close()
        server.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        thread.join(5)


@contextlib.contextmanager
def bad_peer(kind: str, port: int = 0) -> Iterator[str]:
    """A peer of ``kind`` (:data:`KINDS`); its URL."""
    with serving(lambda conn, stop: _answer(kind, conn, stop), port) as url:
        yield url


def signed(key: bytes, node: str, status: int, body: bytes, *, length: int | str | None = None,
           send: bytes | None = None, hold: bool = False) -> Callable[[socket.socket, threading.Event], None]:
    """An answer a holder of ``key`` would sign as node ``node``: ``body`` (its digest signed),
    or with ``length``, a streamed shard of that length of which only ``send`` is sent, then
    the connection is closed (cut short) or, with ``hold``, kept open with nothing more (stalled)."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        rid = request_id(_head(conn))
        if length is None:
            headers = auth.sign_response(key, node, rid, status, auth.body_digest(body))
            payload, declared = body, len(body)
        else:
            headers = auth.sign_response(key, node, rid, status, auth.NO_BODY, str(length))
            payload, declared = send or b"", length  # a str: a length that is no number
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {declared}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
        conn.sendall(head.encode() + payload)
        if hold:
            stop.wait()

    return answer
