"""Client of a storage worker's HTTP API (see workers/app.py), with signed requests.

Uploads send the shard's own header bytes, then the payload straight from the source
file with ``socket.sendfile`` (zero copy); downloads are returned as a stream.
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
from typing import Any
from urllib.parse import urlsplit

from pipeline.cluster import auth
from pipeline.errors import AuthError, UntrustedAnswer, WorkerError

CONNECT_TIMEOUT = 5.0
IO_TIMEOUT = 600.0
#: Clock differences up to this are left to the worker's skew bound.
CLOCK_TOLERANCE = 30.0
#: Per worker URL: what to add to this process's clock to sign (learned from 401s).
_CLOCK_OFFSETS: dict[str, float] = {}
log = logging.getLogger("ckpt.client")


class WorkerClient:
    """Signed requests to the storage worker ``node`` at ``url``, whose answers must be signed
    by that node with the cluster key (``node`` :data:`~pipeline.cluster.auth.ANY_NODE`: a
    status probe of a worker not known yet)."""

    def __init__(self, url: str, key: bytes, node: str, *, timeout: float = IO_TIMEOUT) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"storage worker URL must look like http://HOST:PORT, got {url!r}")
        self.url, self.key, self.node, self.timeout = url.rstrip("/"), key, node, timeout
        self.host, self.port = parts.hostname, parts.port

    # -- plumbing -----------------------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=CONNECT_TIMEOUT, blocksize=1 << 20)
        try:
            conn.connect()
        except OSError as exc:
            raise WorkerError(self.url, f"cannot connect ({exc})") from None
        conn.sock.settimeout(self.timeout)
        return conn

    def _headers(self, method: str, path: str, extra: dict[str, str] | None = None,
                 body: bytes | None = None) -> dict[str, str]:
        h = auth.sign(self.key, method, path, body, now=auth.wall() + _CLOCK_OFFSETS.get(self.url, 0.0),
                      node=self.node)
        if extra:
            h.update(extra)
        return h

    def _authentic(self, headers: dict[str, str], resp: http.client.HTTPResponse, body: bytes | None,
                   what: str) -> str:
        """Raise :class:`WorkerError` unless the answer to the request sent with ``headers`` was
        signed by the node asked (``body`` None: a streamed shard or a HEAD, bound by its
        length); returns the responder's node id."""
        length = "" if body is not None else (resp.getheader("Content-Length") or "")
        try:
            return auth.check_response(self.key, headers[auth.REQUEST_HEADER], resp.status, resp.getheader, body,
                                       node_id=self.node, length=length, head=what.startswith("HEAD "))
        except AuthError as exc:
            said = ""
            try:  # what it says, untrusted: often why (a worker with another key refuses us)
                said = str(json.loads(body or b"{}").get("error") or "")[:200]
            except (ValueError, AttributeError):
                pass
            raise UntrustedAnswer(self.url, f"{what} answered {resp.status}, an answer refused: {exc}"
                                            + (f"; it says (unverified): {said}" if said else "")) from None

    def _learn_clock(self, resp: http.client.HTTPResponse) -> bool:
        """After a 401, sign with the worker's clock from now on if ours is off from it;
        True if that changed how this client signs."""
        if resp.status != 401:
            return False
        theirs = auth.read_clock_hint(self.key, resp.getheader)
        if theirs is None:
            return False
        offset = theirs - auth.wall()
        if abs(offset - _CLOCK_OFFSETS.get(self.url, 0.0)) <= CLOCK_TOLERANCE:
            return False  # refused for another reason
        if abs(offset) <= CLOCK_TOLERANCE:  # our clock was fixed
            _CLOCK_OFFSETS.pop(self.url, None)
            return True
        _CLOCK_OFFSETS[self.url] = offset
        log.warning("this process's clock is %+.0f s off storage worker %s; signing with the worker's time"
                    " (fix the clock: NTP)", -offset, self.url)
        return True

    def _exchange(self, method: str, path: str, body: bytes | None = None,
                  extra: dict[str, str] | None = None) -> tuple[http.client.HTTPResponse, bytes]:
        """One signed request; the response, authenticated, and its whole body.

        Refused because this process's clock is off the worker's, it is signed again once,
        with the worker's time.
        """
        for _ in range(2):
            conn = self._connect()
            headers = self._headers(method, path, extra, body)
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except OSError as exc:
                raise WorkerError(self.url, f"{method} {path} failed ({exc})") from None
            finally:
                conn.close()
            self._authentic(headers, resp, None if method == "HEAD" else data, f"{method} {path}")
            if not self._learn_clock(resp):
                break
        return resp, data

    def _request_json(self, method: str, path: str, doc: Any = None, ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        body = json.dumps(doc).encode() if doc is not None else None
        extra = {"Content-Type": "application/json"} if body is not None else {}
        resp, data = self._exchange(method, path, body, extra)
        return _decode(self.url, method, path, resp.status, data, ok)

    # -- API ---------------------------------------------------------------------------

    def status(self, nonce: str | None = None) -> dict[str, Any]:
        """The worker's status; with ``nonce``, it includes the worker's proof that it holds the
        cluster key, bound to its node id, this client's URL for it and the nonce."""
        extra = {auth.NONCE_HEADER: nonce, auth.URL_HEADER: self.url} if nonce is not None else None
        resp, data = self._exchange("GET", "/v1/status", extra=extra)
        doc = _decode(self.url, "GET", "/v1/status", resp.status, data, (200,))[1]
        if not isinstance(doc, dict) or doc.get("node_id") != resp.getheader(auth.RESPONDER_HEADER):
            raise WorkerError(self.url, "status answer is not a storage worker's", resp.status)
        return doc

    def head(self, name: str) -> int | None:
        path = f"/v1/shards/{name}"
        resp, _ = self._exchange("HEAD", path)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise WorkerError(self.url, f"HEAD {path} answered {resp.status}", resp.status)
        return int(resp.getheader("Content-Length", "0"))

    def put_range(self, name: str, header: bytes, path: str, offset: int, length: int) -> dict[str, Any]:
        """Upload shard ``name``: ``header`` then ``length`` bytes of ``path`` from ``offset``."""
        url_path = f"/v1/shards/{name}"
        conn = self._connect()
        try:
            conn.putrequest("PUT", url_path, skip_accept_encoding=True)
            signed = self._headers("PUT", url_path, {
                "Content-Type": "application/octet-stream",
                "Content-Length": str(len(header) + length),
            })
            for k, v in signed.items():
                conn.putheader(k, v)
            conn.endheaders()
            sent_ok = True
            try:
                if header:
                    conn.sock.sendall(header)
                if length:
                    with open(path, "rb") as f:
                        sent = conn.sock.sendfile(f, offset, length)
                    if sent != length:
                        raise WorkerError(self.url, f"{path} ended after {sent:,} of {length:,} bytes from {offset:,}")
            except (BrokenPipeError, ConnectionResetError):
                sent_ok = False  # the worker refused early; its answer says why
            try:
                resp = conn.getresponse()
                data = resp.read()
            except OSError:
                if not sent_ok:
                    raise WorkerError(self.url, f"PUT {url_path}: connection closed while sending") from None
                raise
        except OSError as exc:
            raise WorkerError(self.url, f"PUT {url_path} failed ({exc})") from None
        finally:
            conn.close()
        self._authentic(signed, resp, data, f"PUT {url_path}")
        self._learn_clock(resp)
        return _decode(self.url, "PUT", url_path, resp.status, data, (200, 201))[1]

    def open_shard(self, name: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Start downloading shard ``name``; the caller reads the response, then closes the connection."""
        path = f"/v1/shards/{name}"
        conn = self._connect()
        headers = self._headers("GET", path)
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            conn.close()
            raise WorkerError(self.url, f"GET {path} failed ({exc})") from None
        if resp.status != 200:
            try:
                data = resp.read()
            except OSError as exc:
                raise WorkerError(self.url, f"GET {path} failed ({exc})") from None
            finally:
                conn.close()
            self._authentic(headers, resp, data, f"GET {path}")
            self._learn_clock(resp)
            _decode(self.url, "GET", path, resp.status, data, (200,))
        try:  # the bytes themselves are checked against the shard's name by the reader
            self._authentic(headers, resp, None, f"GET {path}")
        except WorkerError:
            conn.close()
            raise
        return conn, resp

    def prefetch(self, names: list[str]) -> dict[str, bool]:
        """Ask the worker to start reading ``names`` from its disk (it answers at once)."""
        return self._request_json("POST", "/v1/prefetch", {"shards": names})[1]["held"]

    def verify(self, names: list[str], rate: float = 0) -> list[dict[str, Any]]:
        """Ask the worker to re-hash ``names`` from its disk (at most ``rate`` B/s; 0: unthrottled)."""
        return self._request_json("POST", "/v1/verify", {"shards": names, "rate": rate})[1]["results"]

    def quarantine(self, names: list[str]) -> dict[str, bool]:
        return self._request_json("POST", "/v1/quarantine", {"shards": names})[1]["moved"]

    def purge_quarantined(self, names: list[str]) -> dict[str, int]:
        return self._request_json("POST", "/v1/quarantine/purge", {"shards": names})[1]["purged"]

    def delete(self, name: str) -> bool:
        return self._request_json("DELETE", f"/v1/shards/{name}")[1]["deleted"]

    def copy_from(self, source: WorkerClient, name: str, size: int) -> dict[str, Any]:
        """Stream shard ``name`` from ``source`` into this worker, which checks its hash."""
        src_conn, src = source.open_shard(name)
        url_path = f"/v1/shards/{name}"
        conn = self._connect()
        try:
            conn.putrequest("PUT", url_path, skip_accept_encoding=True)
            signed = self._headers("PUT", url_path, {"Content-Type": "application/octet-stream",
                                                     "Content-Length": str(size)})
            for k, v in signed.items():
                conn.putheader(k, v)
            conn.endheaders()
            buf = memoryview(bytearray(1 << 20))
            sent = 0
            try:
                while sent < size:
                    n = src.readinto(buf)
                    if not n:
                        break
                    conn.sock.sendall(buf[:n])
                    sent += n
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused early: the answer says why
            resp = conn.getresponse()
            data = resp.read()
        except OSError as exc:
            raise WorkerError(self.url, f"copy of {name[:12]} from {source.url} failed ({exc})") from None
        finally:
            conn.close()
            src_conn.close()
        self._authentic(signed, resp, data, f"PUT {url_path}")
        self._learn_clock(resp)
        return _decode(self.url, "PUT", url_path, resp.status, data, (200, 201))[1]

    def inventory_full(self) -> dict[str, Any]:
        return self._request_json("GET", "/v1/inventory")[1]

    def stat(self, names: list[str]) -> dict[str, int | None]:
        return self._request_json("POST", "/v1/stat", {"shards": names})[1]["sizes"]

    def delete_many(self, names: list[str]) -> dict[str, bool]:
        """Delete shards (garbage collection); name -> whether it was there."""
        return self._request_json("POST", "/v1/delete", {"shards": names})[1]["deleted"]

    def inventory_page(self, after: str = "", limit: int = 1000) -> list[tuple[str, int]]:
        """Up to ``limit`` held shards named after ``after``, in name order (empty: the end)."""
        path = f"/v1/inventory?after={after}&limit={limit}"
        resp, data = self._exchange("GET", path)
        doc = _decode(self.url, "GET", path, resp.status, data, (200,))[1]
        return [(str(n), int(s)) for n, s in doc["shards"]]

    def inventory(self) -> list[tuple[str, int]]:
        return [(n, s) for n, s in self._request_json("GET", "/v1/inventory")[1]["shards"]]


def _decode(url: str, method: str, path: str, status: int, data: bytes, ok: tuple[int, ...]) -> tuple[int, Any]:
    try:
        doc = json.loads(data) if data else None
    except ValueError:
        doc = None
    if status not in ok:
        reason = doc.get("error") if isinstance(doc, dict) else data[:200].decode(errors="replace")
        raise WorkerError(url, f"{method} {path} answered {status}: {reason}", status)
    return status, doc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for local workers and tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


__all__ = ["WorkerClient", "free_port"]
