"""Client of a storage worker's HTTP API (see workers/app.py), with signed requests.

Uploads send the shard's own header bytes, then the payload straight from the source
file with ``socket.sendfile`` (zero copy); downloads are returned as a stream.
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

from pipeline.cluster import auth
from pipeline.cluster import wire as wire_mod
from pipeline.cluster.decoding import CONTENT_TYPES, Decompressing, decoding
from pipeline.cluster.faults import PEER_FAULTS, describe, send_all
from pipeline.cluster.wire import METER
from pipeline.errors import AuthError, MalformedStream, UntrustedAnswer, WorkerError

CONNECT_TIMEOUT = 5.0
#: How long a request waits for an answer with no byte moving, where the worker works before
#: it answers (a re-hash of a batch of shards); transfers pass their own (``CKPT_STALL_SECONDS``).
IO_TIMEOUT = 600.0
#: A chain hop not told how long a hop may stall (an older sender) uses this.
STALL_SECONDS = 60.0
#: Clock differences up to this are left to the worker's skew bound.
CLOCK_TOLERANCE = 30.0
#: The most a status answer may hold: a worker's is a few hundred bytes (counters, never a
#: list of shards: the inventory is paged); a peer sending more is not a storage worker.
STATUS_MAX_BYTES = 1 << 20
#: Per worker URL: what to add to this process's clock to sign (learned from 401s).
_CLOCK_OFFSETS: dict[str, float] = {}
#: How long what a worker said it decodes is taken as true: a host upgraded (or rolled back)
#: meanwhile gets the frames it decodes after this at the latest (a refused upload forgets at once).
DECODES_SECONDS = 60.0
#: Per worker URL: when its status was read, and the codecs it decodes (pipeline/cluster/wire.py).
_DECODES: dict[str, tuple[float, tuple[str, ...]]] = {}
#: What a download asks to be answered in, best first (pipeline/cluster/wire.py).
ACCEPT = ", ".join(CONTENT_TYPES[c] for c in wire_mod.DECODES)
log = logging.getLogger("ckpt.client")


class WorkerClient:
    """Signed requests to the storage worker ``node`` at ``url``, whose answers must be signed
    by that node with the cluster key (``node`` :data:`~pipeline.cluster.auth.ANY_NODE`: a
    status probe of a worker not known yet). ``timeout``: how long an exchange may go with no
    byte moving (an upload through a chain waits that long per worker it reaches: :class:`Upload`).
    Whatever goes wrong below (the peer's answer is not HTTP, is cut short, is not the JSON
    asked for; the link breaks or stalls) is raised as :class:`WorkerError` for this worker."""

    def __init__(self, url: str, key: bytes, node: str, *, timeout: float = IO_TIMEOUT) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"storage worker URL must look like http://HOST:PORT, got {url!r}")
        self.url, self.key, self.node, self.timeout = url.rstrip("/"), key, node, timeout
        self.host, self.port = parts.hostname, parts.port

    # -- plumbing -----------------------------------------------------------------------

    def _connect(self, within: float | None = None) -> http.client.HTTPConnection:
        """A connection to the worker; ``within``: seconds left for the whole exchange."""
        wait = CONNECT_TIMEOUT if within is None else max(0.001, min(CONNECT_TIMEOUT, within))
        conn = http.client.HTTPConnection(self.host, self.port, timeout=wait, blocksize=1 << 20)
        try:
            conn.connect()
        except PEER_FAULTS as exc:
            conn.close()
            raise WorkerError(self.url, f"cannot connect ({describe(exc, wait)})") from None
        conn.sock.settimeout(self.timeout)
        return conn

    def _failed(self, what: str, exc: BaseException) -> WorkerError:
        """The error of this worker for ``exc``, raised below while doing ``what``."""
        return WorkerError(self.url, f"{what} failed ({describe(exc, self.timeout)})")

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
            except (ValueError, AttributeError, RecursionError):
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
                  extra: dict[str, str] | None = None, *, within: float | None = None,
                  limit: int | None = None) -> tuple[http.client.HTTPResponse, bytes]:
        """One signed request; the response, authenticated, and its whole body.

        Refused because this process's clock is off the worker's, it is signed again once,
        with the worker's time. ``within``: seconds the whole exchange may take, connecting
        included (the socket's timeout bounds each receive only: a peer sending a byte now and
        then would hold it forever); ``limit``: the most bytes its body may hold.
        """
        deadline = None if within is None else time.monotonic() + within
        for _ in range(2):
            late = WorkerError(self.url, f"{method} {path} failed (no full answer within {within or 0:g} s)")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise late
            conn = self._connect(left)
            headers = self._headers(method, path, extra, body)
            cutoff = _Cutoff(conn, left)
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = _read(self.url, f"{method} {path}", resp, limit)
                if cutoff.fired:  # a body read to the connection's end, ended by the cutoff
                    raise late
            except PEER_FAULTS as exc:
                raise (late if cutoff.fired else self._failed(f"{method} {path}", exc)) from None
            finally:
                cutoff.cancel()
                conn.close()
            self._authentic(headers, resp, None if method == "HEAD" else data, f"{method} {path}")
            if not self._learn_clock(resp):
                break
        return resp, data

    def _request_json(self, method: str, path: str, doc: Any, field: str, kind: type) -> Any:
        """The ``field`` of the worker's JSON answer, which must be a ``kind``: any other
        answer is this worker's :class:`WorkerError`, never a KeyError of the caller's."""
        body = json.dumps(doc).encode() if doc is not None else None
        extra = {"Content-Type": "application/json"} if body is not None else {}
        resp, data = self._exchange(method, path, body, extra)
        answer = _decode(self.url, method, path, resp.status, data, (200,))[1]
        value = answer.get(field) if isinstance(answer, dict) else None
        if not isinstance(value, kind):
            raise WorkerError(self.url, f"{method} {path} answered {resp.status} without {field!r} "
                                        f"(a {kind.__name__}): {data[:120]!r}", resp.status)
        return value

    # -- API ---------------------------------------------------------------------------

    def status(self, nonce: str | None = None, *, within: float | None = None) -> dict[str, Any]:
        """The worker's status; with ``nonce``, it includes the worker's proof that it holds the
        cluster key, bound to its node id, this client's URL for it and the nonce. ``within``:
        seconds the whole exchange may take (a probe); the answer holds at most
        :data:`STATUS_MAX_BYTES`."""
        extra = {auth.NONCE_HEADER: nonce, auth.URL_HEADER: self.url} if nonce is not None else None
        resp, data = self._exchange("GET", "/v1/status", extra=extra, within=within, limit=STATUS_MAX_BYTES)
        doc = _decode(self.url, "GET", "/v1/status", resp.status, data, (200,))[1]
        if not isinstance(doc, dict) or doc.get("node_id") != resp.getheader(auth.RESPONDER_HEADER):
            raise WorkerError(self.url, "status answer is not a storage worker's", resp.status)
        _DECODES[self.url] = (time.monotonic(), wire_mod.announced(doc))
        return doc

    def decodes(self) -> tuple[str, ...]:
        """The codecs of frames this worker decodes, as its status said within
        :data:`DECODES_SECONDS` (asked now if not): none if it cannot say."""
        known = _DECODES.get(self.url)
        if known is None or time.monotonic() - known[0] > DECODES_SECONDS:
            try:
                self.status(within=CONNECT_TIMEOUT)
            except WorkerError:
                return ()  # whatever is sent to it will not get far: bytes as they are
            known = _DECODES[self.url]
        return known[1]

    def forget_decodes(self) -> None:
        """It refused frames it was thought to decode (rolled back to an older release, it
        answers 411 to ``?planes=``): ask again."""
        _DECODES.pop(self.url, None)

    def head(self, name: str) -> int | None:
        path = f"/v1/shards/{name}"
        resp, _ = self._exchange("HEAD", path)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise WorkerError(self.url, f"HEAD {path} answered {resp.status}", resp.status)
        length = resp.getheader("Content-Length", "0")
        if not length.isdigit() or len(length) > 18:
            raise WorkerError(self.url, f"HEAD {path} answered a length that is no byte count: {length[:40]!r}", 200)
        return int(length)

    def put_range(self, name: str, header: bytes, path: str, offset: int, length: int,
                  chain: Sequence[tuple[str, str]] = (), *, wire: str = "off",
                  codecs: Sequence[str] = wire_mod.DECODES) -> dict[str, Any]:
        """Upload shard ``name``: ``header`` then ``length`` bytes of ``path`` from ``offset``.
        ``chain``: (node id, url) of workers this one forwards the bytes to as they arrive
        (workers/chain.py); the answer's ``chain`` says what each of them answered.
        ``wire="auto"``: compressed when that is faster (pipeline/cluster/wire.py); ``"on"``:
        whenever the worker is on another host and the shard compresses; either in the frames
        that this worker and every one of ``chain`` decode, the first of ``codecs`` they all do."""
        total = len(header) + length
        first: tuple[int, bytes] | None = None

        def compress(sock: socket.socket) -> str | None:
            nonlocal first
            if wire not in ("auto", "on") or total < wire_mod.MIN_SIZE or wire_mod.same_host(sock) \
                    or wire == "auto" and not METER.worth_it(self.url, "up", cores=False):
                return None
            codec = wire_mod.common_codec((w.decodes() for w in self._along(chain)), codecs)
            if codec is None:
                return None
            if wire == "auto" and wire_mod.CPU.idle() < wire_mod.MIN_IDLE:
                # No cores to spare now: raw frames, and compressed blocks once there are, if
                # it lasts long enough for that; else as it is.
                return codec if METER.lasts(self.url, "up", total, wire_mod.BUSY_START_SECONDS) else None
            n, frame, ratio = wire_mod.sample(header, path, offset, length, codec)
            first = (n, frame)
            return codec if ratio <= wire_mod.MAX_RATIO else None

        started = time.monotonic()
        up = Upload(self, name, total, chain, compress=compress)
        frames: wire_mod.Frames | None = None
        try:
            if up.codec:
                frames = wire_mod.Frames(header, path, offset, length, first, per_block=wire == "auto",
                                         codec=up.codec)
                for frame in frames:
                    up.send(frame)
                    if up.broken is not None:
                        break
                sent_bytes = frames.wire
            else:
                if header:
                    up.send(header)
                if length and up.broken is None:
                    with open(path, "rb") as f:
                        sent = up.sendfile(f, offset, length)
                    if sent != length and up.broken is None:
                        raise WorkerError(self.url, f"{path} ended after {sent:,} of {length:,} bytes from {offset:,}")
                sent_bytes = total
        except BaseException:
            up.close()
            raise
        answer = up.finish()
        if up.codec:
            self._refused_frames(answer, chain)
        METER.transfer(self.url, "up", total, sent_bytes, time.monotonic() - started,
                       packed=frames.packed if frames is not None else None)
        return answer

    def _along(self, chain: Sequence[tuple[str, str]]) -> list[WorkerClient]:
        """This worker and the clients of those of ``chain``."""
        return [self, *(WorkerClient(url, self.key, node, timeout=self.timeout) for node, url in chain)]

    def _refused_frames(self, answer: dict[str, Any], chain: Sequence[tuple[str, str]]) -> None:
        """Forget what the hops of ``chain`` that refused a compressed upload said they decode:
        the copy is sent again, and they are asked first."""
        refused = {str(r.get("node")) for r in answer.get("chain") or []
                   if isinstance(r, dict) and isinstance(r.get("status"), int) and r["status"] >= 400}
        for w in self._along(chain)[1:]:
            if w.node in refused:
                w.forget_decodes()

    def open_shard(self, name: str, *, size: int = 0, wire: str = "off", codecs: Sequence[str] = wire_mod.DECODES
                   ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse | Decompressing]:
        """Start downloading shard ``name``; the caller reads the stream, then closes the
        connection. ``wire="auto"`` (with the shard's ``size``): asked compressed when that is
        faster, in the frames of ``codecs`` (best first), and the stream given back decompresses
        (pipeline/cluster/wire.py)."""
        conn = self._connect()
        compressed = (wire in ("auto", "on") and size >= wire_mod.MIN_SIZE and not wire_mod.same_host(conn.sock)
                      and (wire == "on" or METER.worth_it(self.url, "down")))
        path = f"/v1/shards/{name}" + ("?zstd=1" if compressed else "")
        accept = ", ".join(CONTENT_TYPES[c] for c in codecs if c in wire_mod.DECODES) or ACCEPT
        headers = self._headers("GET", path, {"Accept": accept} if compressed else None)
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
        except PEER_FAULTS as exc:
            conn.close()
            raise self._failed(f"GET {path}", exc) from None
        if resp.status != 200:
            try:
                data = resp.read()
            except PEER_FAULTS as exc:
                raise self._failed(f"GET {path}", exc) from None
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
        # Asked, not ordered: a worker with no cores to spare answers plain; one of the
        # previous release, in zstd frames whatever was accepted.
        codec = next((c for c, t in CONTENT_TYPES.items() if t == resp.getheader("Content-Type")), None)
        return conn, (decoding(codec, resp, size) if compressed and codec else resp)

    def verify(self, names: list[str], rate: float = 0) -> list[dict[str, Any]]:
        """Ask the worker to re-hash ``names`` from its disk (at most ``rate`` B/s; 0: unthrottled):
        per name, in order, ``{"name", "sha256" (None: not held), "size"}``."""
        results = self._request_json("POST", "/v1/verify", {"shards": names, "rate": rate}, "results", list)
        if len(results) != len(names) or any(
                not isinstance(r, dict) or r.get("name") != n or not isinstance(r.get("sha256"), (str, type(None)))
                for r, n in zip(results, names, strict=True)):
            raise WorkerError(self.url, f"POST /v1/verify answered re-hashes that are not those of the "
                                        f"{len(names)} shards asked", 200)
        return results

    def push(self, name: str, size: int, url: str, headers: dict[str, str]) -> dict[str, Any]:
        """Have the worker PUT its copy of ``name`` to ``url`` (a presigned object-store PUT,
        workers/push.py): the store's ``{"status", "checksum", "error"}``. A worker of an
        earlier release answers 404 (no such endpoint): a :class:`WorkerError` with that status."""
        doc = {"shards": [name], "size": size, "url": url, "headers": headers}
        return self._request_json("POST", "/v1/push", doc, "push", dict)

    def quarantine(self, names: list[str]) -> dict[str, bool]:
        return self._request_json("POST", "/v1/quarantine", {"shards": names}, "moved", dict)

    def purge_quarantined(self, names: list[str]) -> dict[str, int]:
        return self._request_json("POST", "/v1/quarantine/purge", {"shards": names}, "purged", dict)

    def delete(self, name: str) -> bool:
        return self._request_json("DELETE", f"/v1/shards/{name}", None, "deleted", bool)

    def copy_from(self, source: WorkerClient, name: str, size: int) -> dict[str, Any]:
        """Stream shard ``name`` from ``source`` into this worker, which checks its hash. A
        failure reading from ``source`` is the source's :class:`WorkerError` (try another
        copy); one sending is this worker's."""
        src_conn, src = source.open_shard(name)
        try:
            up = Upload(self, name, size)
            try:
                buf = memoryview(bytearray(1 << 20))
                sent = 0
                while sent < size and up.broken is None:
                    n = src.readinto(buf)
                    if not n:
                        raise http.client.IncompleteRead(b"", size - sent)  # ended early: the source's fault
                    up.send(buf[:n])
                    sent += n
            except (OSError, http.client.HTTPException, MalformedStream) as exc:  # PEER_FAULTS, or a bad stream
                up.close()
                raise source._failed(f"GET of {name[:12]} to copy it to {self.url}", exc) from None
            return up.finish()
        finally:
            src_conn.close()

    def stat(self, names: list[str]) -> dict[str, int | None]:
        return self._request_json("POST", "/v1/stat", {"shards": names}, "sizes", dict)

    def delete_many(self, names: list[str]) -> dict[str, bool]:
        """Delete shards (garbage collection); name -> whether it was there."""
        return self._request_json("POST", "/v1/delete", {"shards": names}, "deleted", dict)

    def inventory_page(self, after: str = "", limit: int = 1000) -> list[tuple[str, int]]:
        """Up to ``limit`` held shards named after ``after``, in name order (empty: the end)."""
        return self._shards(f"/v1/inventory?after={after}&limit={limit}")

    def inventory(self) -> list[tuple[str, int]]:
        return self._shards("/v1/inventory")

    def _shards(self, path: str) -> list[tuple[str, int]]:
        try:
            return [(str(n), int(size)) for n, size in self._request_json("GET", path, None, "shards", list)]
        except (TypeError, ValueError):
            raise WorkerError(self.url, f"GET {path} answered a list that is not of (name, size) pairs", 200) from None


def shard_path(name: str, chain: Sequence[tuple[str, str]] = (), *, frames: tuple[str, int] | None = None,
               stall: float | None = None) -> str:
    """The path of an upload, with the workers it is forwarded to and how long each hop may
    stall before the one before it gives up on it, and, if its body is frames, their codec
    and its raw length (``?planes=<bytes>``, ``?zstd=<bytes>``; all signed with the request)."""
    query = []
    if frames is not None:
        query.append(f"{frames[0]}={frames[1]}")
    if chain:
        query.append("next=" + ",".join(f"{node}@{quote(url, safe='')}" for node, url in chain))
        if stall is not None:
            query.append(f"stall={stall:g}")
    return f"/v1/shards/{name}" + ("?" + "&".join(query) if query else "")


class Upload:
    """One shard's PUT, its bytes sent as they come (a file's range, a peer's stream, or a
    chain hop forwarding what it receives). A worker that stops reading (it refused early,
    or died) marks the upload ``broken``; :meth:`finish` then reports its answer, if any.

    ``compress`` (a codec, or asked with the connected socket: None, bytes as they are): the
    bytes sent are frames of that codec, of ``length`` raw bytes, in a chunked body
    (pipeline/cluster/wire.py).

    Deadlines are by progress, and blame by evidence: the client's timeout is how long one
    worker may leave the transfer with no byte moving. Through a chain of ``n`` workers this
    upload waits ``n`` times that, and tells each hop to wait that long per worker after it
    (``?stall=``): when a hop stalls, the worker before it gives up first, and its answer
    names the stalled hop while the ones before it are still waiting, and are not blamed."""

    def __init__(self, client: WorkerClient, name: str, length: int, chain: Sequence[tuple[str, str]] = (),
                 *, compress: str | None | Callable[[socket.socket], str | None] = None) -> None:
        self.client = client
        self.broken: str | None = None
        #: The worker took no byte for the stall timeout: no answer is coming either.
        self.stalled = False
        self.timeout = client.timeout * (1 + len(chain))
        self.conn = client._connect()
        try:
            self.conn.sock.settimeout(self.timeout)
            #: The codec of the frames sent (None: the bytes as they are).
            self.codec = compress(self.conn.sock) if callable(compress) else compress
        except BaseException:
            self.conn.close()
            raise
        self.path = shard_path(name, chain, frames=(self.codec, length) if self.codec else None, stall=client.timeout)
        framing = ({"Content-Type": CONTENT_TYPES[self.codec], "Transfer-Encoding": "chunked"} if self.codec
                   else {"Content-Type": "application/octet-stream", "Content-Length": str(length)})
        try:
            self.conn.putrequest("PUT", self.path, skip_accept_encoding=True)
            self.signed = client._headers("PUT", self.path, framing)
            for k, v in self.signed.items():
                self.conn.putheader(k, v)
            self.conn.endheaders()
        except PEER_FAULTS as exc:
            self.conn.close()
            raise client._failed(f"PUT {self.path}", exc) from None

    def _broke(self, exc: BaseException) -> None:
        self.broken = describe(exc, self.timeout)
        self.stalled = isinstance(exc, TimeoutError)

    def send(self, data: bytes | memoryview) -> None:
        if self.broken is None and len(data):
            try:
                if self.codec:
                    send_all(self.conn.sock, b"%x\r\n" % len(data))
                send_all(self.conn.sock, data)
                if self.codec:
                    send_all(self.conn.sock, b"\r\n")
            except OSError as exc:
                self._broke(exc)

    def sendfile(self, f: Any, offset: int, length: int) -> int:
        """Send a file's range (zero copy; each wait for the worker bounded by the stall
        timeout); an error reading the file is raised as it is."""
        try:
            return self.conn.sock.sendfile(f, offset, length)
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as exc:
            self._broke(exc)
            return 0

    def finish(self) -> dict[str, Any]:
        """The worker's answer, authenticated; raises :class:`WorkerError` unless it stored the
        shard (at once if it stalled: a worker that took no byte for the stall timeout is not
        waited for again)."""
        c = self.client
        if self.codec and self.broken is None:
            try:
                send_all(self.conn.sock, b"0\r\n\r\n")  # the chunked body's end
            except OSError as exc:
                self._broke(exc)
        if self.stalled:
            self.conn.close()
            raise WorkerError(c.url, f"PUT {self.path} stalled: {self.broken}")
        try:
            resp = self.conn.getresponse()
            data = resp.read()
        except PEER_FAULTS as exc:
            why = f"connection closed while sending ({self.broken})" if self.broken else describe(exc, self.timeout)
            raise WorkerError(c.url, f"PUT {self.path} failed ({why})") from None
        finally:
            self.conn.close()
        c._authentic(self.signed, resp, data, f"PUT {self.path}")
        c._learn_clock(resp)
        if self.codec and resp.status >= 400:
            c.forget_decodes()  # refused (a worker rolled back takes no planes frames): asked again before the next
        doc = _decode(c.url, "PUT", self.path, resp.status, data, (200, 201))[1]
        if not isinstance(doc, dict):
            raise WorkerError(c.url, f"PUT {self.path} answered {resp.status} without a JSON object", resp.status)
        return doc

    def close(self) -> None:
        self.conn.close()


class _Cutoff:
    """Ends a connection ``within`` seconds from now (None: never) unless cancelled first: a
    shutdown wakes whatever waits on its socket, so no receive outlives the exchange's deadline."""

    def __init__(self, conn: http.client.HTTPConnection, within: float | None) -> None:
        self.conn, self.fired = conn, False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if within is not None:
            self._timer = threading.Timer(within, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._timer is None or self.conn.sock is None:
                return
            self.fired = True
            try:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


def _read(url: str, what: str, resp: http.client.HTTPResponse, limit: int | None) -> bytes:
    """``resp``'s whole body, refused (this worker's error) past ``limit`` bytes before more is read."""
    if limit is None:
        return resp.read()
    too_big = f"more than the {limit:,} bytes such an answer holds"
    length = resp.getheader("Content-Length") or ""
    if length.isdigit() and int(length) > limit:
        raise WorkerError(url, f"{what} declared {int(length):,} bytes, {too_big}", resp.status)
    data = resp.read(limit + 1)
    if len(data) > limit:
        raise WorkerError(url, f"{what} answered {too_big}", resp.status)
    if resp.length:  # a read of so many bytes returns what came before the end: cut short
        raise http.client.IncompleteRead(data, resp.length)
    return data


def _decode(url: str, method: str, path: str, status: int, data: bytes, ok: tuple[int, ...]) -> tuple[int, Any]:
    try:
        doc = json.loads(data) if data else None
    except (ValueError, RecursionError):  # RecursionError: hostile nesting
        if status in ok:
            raise WorkerError(url, f"{method} {path} answered {status} with a body that is not JSON: "
                                   f"{data[:80]!r}", status) from None
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
