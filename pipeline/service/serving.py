"""Serving a WSGI app with gunicorn's threaded workers (never the werkzeug dev server).

gthread workers keep long responses alive (uploads, shard downloads, server-sent events)
and serve other requests meanwhile; the sync worker would cut a stream at its timeout.
"""
from __future__ import annotations

import errno
import socket
import time
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.http.message import Request
from gunicorn.workers import gthread
from gunicorn.workers.gthread import TConn, ThreadWorker

_DEFER = getattr(gthread, "_DEFER", None)  # gunicorn >= 25: park a connection in the poller

#: A request's headers must arrive within this many seconds of the thread taking the
#: connection: a client that sends them a byte at a time (slow-loris) would otherwise hold
#: one of the few threads for as long as it likes.
HEADER_SECONDS = 2.0
#: Once the headers are in, a body or keep-alive read that gets no byte for this long ends.
IDLE_SECONDS = 120.0


class _DeadlineSocket:
    """A connection's socket whose reads fail once the header deadline has passed."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline: float | None = None

    def recv(self, n: int, *flags: int) -> bytes:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ConnectionResetError(errno.ECONNRESET, f"request headers not complete in {HEADER_SECONDS} s")
            current = self._sock.gettimeout()
            self._sock.settimeout(min(left, current) if current else left)
        elif self._sock.gettimeout() is None:
            self._sock.settimeout(IDLE_SECONDS)
        try:
            return self._sock.recv(n, *flags)
        except TimeoutError:
            raise ConnectionResetError(errno.ECONNRESET, "client too slow") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


#: Headers larger than this are left to gunicorn's parser, which refuses them.
_PEEK = 64 * 1024


def _drop(conn: TConn) -> bool:
    """Close a connection at once. gunicorn's graceful close would linger on it, draining
    what the client still sends for up to 2 s, in its main loop: one slow client at a time."""
    try:
        conn.sock._sock.close()
    except OSError:
        pass
    return False


class DeadlineThreadWorker(ThreadWorker):
    """gunicorn's gthread worker that gives a connection a thread only once its request
    headers are all in.

    Until then the connection waits in gunicorn's poller (its ``_DEFER`` path, like an idle
    connection), not in a thread; one whose headers are not complete within
    ``HEADER_SECONDS`` is closed. A reading thread also fails at that deadline.
    """

    def handle(self, conn: TConn) -> Any:
        if not isinstance(conn.sock, _DeadlineSocket):
            conn.sock = _DeadlineSocket(conn.sock)
            conn.ckpt_since = time.monotonic()
        since = getattr(conn, "ckpt_since", None) or time.monotonic()
        conn.ckpt_since = since
        buffered = conn.parser is not None and conn.parser.unreader.buf.getvalue()
        if _DEFER is not None and not buffered:
            # Take what has arrived (so the socket is readable again only when more does).
            try:
                chunk = conn.sock._sock.recv(_PEEK, socket.MSG_DONTWAIT)
            except BlockingIOError:
                chunk = None
            except OSError:
                return _drop(conn)
            if chunk == b"":
                return _drop(conn)  # closed by the client
            head = getattr(conn, "ckpt_head", b"") + (chunk or b"")
            if b"\r\n\r\n" not in head and len(head) < _PEEK:
                if time.monotonic() - since > HEADER_SECONDS:
                    return _drop(conn)  # too slow
                conn.ckpt_head, conn.data_ready = head, False
                return _DEFER  # back to the poller until more bytes come
            conn.ckpt_head = b""
            conn.init()
            conn.parser.unreader.unread(head)  # the parser reads these first
            conn.data_ready = True
        conn.sock.deadline = since + HEADER_SECONDS
        return super().handle(conn)

    def handle_request(self, req: Request, conn: TConn) -> Any:
        conn.sock.deadline = None  # the headers are in: the body may take its time
        conn.ckpt_since = None  # the next request's headers start their own clock
        return super().handle_request(req, conn)


class _Gunicorn(BaseApplication):
    def __init__(self, app: Any, options: dict[str, Any]) -> None:
        self.application, self.options = app, options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        return self.application


def run(app: Any, *, host: str, port: int, threads: int, name: str, **options: Any) -> None:
    """Serve ``app`` on ``host:port`` in the foreground until SIGTERM/SIGINT."""
    config = {
        "bind": f"{host}:{port}",
        "workers": 1,
        "worker_class": "pipeline.service.serving.DeadlineThreadWorker",
        "threads": threads,
        # Long transfers and streams are fine: the gthread worker heartbeats from its
        # main loop, so this only bounds a hung worker.
        "timeout": 120,
        "graceful_timeout": 10,
        "keepalive": 75,
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "warning",
        "proc_name": name,
        "sendfile": True,
    }
    config.update(options)
    _Gunicorn(app, config).run()
