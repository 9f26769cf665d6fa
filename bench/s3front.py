"""An HTTP front for an S3 server that can answer in its place: the faults a store shows.

:class:`Front` relays every request to the server (over TCP, or over the unix socket SeaweedFS
opens with ``-s3.localSocket``, which a front in another network namespace reaches through the
file system) unless :meth:`Front.fault` names an error to answer instead, with an S3 error body
(503 SlowDown: throttling). Headers pass unchanged, the Host among them, so a request signed for
the front's address verifies on the server. The tests' ``FlakyFront`` and the chaos soak's
object-store front (bench/chaos/front.py) are fronts.
"""
from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over a unix socket."""

    def __init__(self, path: str, timeout: float = 30) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class Front:
    """Serves on ``address`` (port 0: a free one), relays to ``upstream()``'s server."""

    def __init__(self, upstream: Callable[[], http.client.HTTPConnection],
                 address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        front = self
        self._lock = threading.Lock()
        self.connections: set[socket.socket] = set()  # open ones (kept alive between requests)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                with front._lock:
                    front.connections.add(self.connection)

            def finish(self):
                with front._lock:
                    front.connections.discard(self.connection)
                super().finish()

            def relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = front.fault(self.command)
                if fault is not None:
                    status, code = fault
                    xml = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                           f"<Message>injected</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD's answer has no body: bytes written here would be
                        self.wfile.write(xml)   # read as the next answer's status line on this connection
                    return
                conn = upstream()
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    r = conn.getresponse()
                    data = r.read()
                finally:
                    conn.close()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                # A HEAD's length is the object's, as the server said; a body's is what was read.
                self.send_header("Content-Length", r.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

        self.httpd = ThreadingHTTPServer(address, Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://{address[0]}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def fault(self, method: str) -> tuple[int, str] | None:
        """The (status, S3 error code) to answer this request with instead of the server's; None: relay."""
        return None

    def start(self) -> Front:
        self.thread.start()
        return self

    def close(self) -> None:
        """Gone: nothing listens on its port, and the connections it kept alive are cut (a
        client holding one must not go on being served by a front that is down)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        with self._lock:
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
