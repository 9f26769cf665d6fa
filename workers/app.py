"""The storage worker's HTTP API, as a plain WSGI application.

    GET    /v1/status              node id, API version, zone, capacity, free, shard count, the codecs of
                                   frames it decodes ("decodes": ["planes", "zstd"]), the shards
                                   that crossed compressed ("zstd": received_/sent_ shards, raw, wire), every
                                   upload it took ("uploads": shards and raw bytes, held ones included), what it put on
                                   object stores ("pushes": shards and bytes), the
                                   filesystem its shards are on ("filesystem": id, capacity, free: workers
                                   on one disk report one id, and the cluster counts it once), and
                                   with X-Ckpt-Nonce and X-Ckpt-Url a proof that this worker, reached
                                   at that URL, holds the cluster key (421 for a URL that is not its own)
    HEAD   /v1/shards/<sha256>     200 with Content-Length if held, else 404
    GET    /v1/shards/<sha256>     the shard's bytes, streamed (sendfile where the server can); with
                                   ?zstd=1 as frames, chunked: planes frames if the Accept header names
                                   them, else zstd frames (pipeline/cluster/wire.py)
    PUT    /v1/shards/<sha256>     store; 201 created, 200 already present, 422 hash mismatch; with
                                   ?next=<node>@<url>,... also stream it on to those workers as it
                                   arrives (workers/chain.py), each one's answer in "chain"; with
                                   ?planes=<raw length> (or ?zstd=<raw length>), a chunked body of
                                   planes (zstd) frames (pipeline/cluster/wire.py)
    DELETE /v1/shards/<sha256>     remove a surplus copy
    POST   /v1/verify              {"shards": [...], "rate": B/s} -> re-hash each from the disk
    POST   /v1/push                {"shards": [sha256], "size": n, "url": presigned PUT, "headers": {x-amz-*}}
                                   -> put the shard on an object store (workers/push.py): {"push":
                                   {"status", "checksum", "error"}}
    POST   /v1/stat                {"shards": [...]} -> size of each, or null
    POST   /v1/quarantine          {"shards": [...]} -> move aside (not served, not counted)
    POST   /v1/quarantine/purge    {"shards": [...]} -> delete the quarantined copies
    POST   /v1/delete              {"shards": [...]} -> delete them (garbage collection)
    GET    /v1/inventory           {"shards": [[sha256, size], ...], "quarantined": [...]}; with
                                   ?after=<sha256>&limit=<n>, one page in hash order (no quarantine)

Every request must be signed with the cluster key, once, for this node (pipeline.cluster.auth: a
replayed request, one meant for another node or a JSON body other than the signed one is refused
with 401); answers are JSON (shards: their bytes) and every answer is signed with the key.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO, cast
from urllib.parse import parse_qs, urlsplit

from pipeline import failpoints
from pipeline.cluster import auth
from pipeline.cluster.decoding import CONTENT_TYPES, PLANES, ZSTD, decoding
from pipeline.cluster.wire import CPU, DECODES, MIN_IDLE, accepted, file_frames, own_address
from pipeline.errors import AuthError, ShardRefused
from workers import chain, push
from workers.shardstore import ShardStore, Throttle, valid_name

API_VERSION = 1
MAX_JSON_BODY = 16 * 1024 * 1024
MAX_NAMES = 100_000

log = logging.getLogger("ckpt.worker")

StartResponse = Callable[..., Any]

_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 411: "Length Required", 413: "Payload Too Large",
            421: "Misdirected Request", 422: "Unprocessable Entity", 500: "Internal Server Error",
            507: "Insufficient Storage"}


def _json(start: StartResponse, status: int, doc: Any) -> list[bytes]:
    body = json.dumps(doc).encode()
    start(f"{status} {_REASONS.get(status, 'Error')}",
          [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
           (auth.RESPONSE_BODY_HEADER, auth.body_digest(body))])
    return [body]


def _error(start: StartResponse, status: int, reason: str,
           headers: Sequence[tuple[str, str]] = ()) -> list[bytes]:
    # The request body may be unread (a refused upload): close rather than drain it.
    body = json.dumps({"error": reason}).encode()
    start(f"{status} {_REASONS.get(status, 'Error')}",
          [("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Connection", "close"),
           (auth.RESPONSE_BODY_HEADER, auth.body_digest(body)),
           *headers])
    return [body]


class WorkerApp:
    def __init__(self, store: ShardStore, *, key: bytes, node_id: str, zone: str = "",
                 max_skew: float = 300.0, max_upload: int = 0, host: str = "", port: int = 0,
                 urls: Sequence[str] = (), compress: str = "auto") -> None:
        self.store, self.key, self.node_id, self.zone, self.max_skew = store, key, node_id, zone, max_skew
        #: Whether a download asked compressed gets it (CKPT_WIRE_COMPRESSION): ``auto`` while
        #: this host has cores to spare, ``on`` always, ``off`` never.
        self.compress = compress
        self.max_upload = max_upload  # 0: only the free space bounds an upload
        self.replay = auth.ReplayGuard(max_skew)
        #: Where this worker may be reached: its own port on the address it is bound to (any of
        #: this host's addresses if bound to all), and the URLs it was told it is reached at (a
        #: port forward); it proves itself for no other.
        self.host, self.port, self.urls = host, port, {u.rstrip("/") for u in urls}
        #: Shards that crossed the wire compressed, and their raw and compressed bytes
        #: ("received_*": uploads, "sent_*": downloads), shown in the status answer.
        self.wire: Counter[str] = Counter()
        #: Every upload taken (a shard sent twice counts twice): shards and raw bytes.
        self.uploads: Counter[str] = Counter()
        #: Its copies it put on object stores (POST /v1/push): shards and bytes the stores took.
        self.pushes: Counter[str] = Counter()
        self._wire_lock = threading.Lock()

    def count_wire(self, way: str, raw: int, wire: int, shards: int = 1) -> None:
        with self._wire_lock:
            self.wire.update({f"{way}_shards": shards, f"{way}_raw": raw, f"{way}_wire": wire})

    def __call__(self, environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        path = environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        signed = f"{path}?{query}" if query else path  # the query is signed too
        start = self._signing(start, str(environ.get("HTTP_X_CKPT_REQUEST") or "")[:64])
        try:
            headers = {h: environ.get("HTTP_" + h.upper().replace("-", "_")) for h in auth.SIGNED_HEADERS}
            environ["ckpt.body_digest"] = auth.check(self.key, method, signed, headers, self.max_skew, self.replay,
                                                     node_id=self.node_id,
                                                     any_node=method == "GET" and path == "/v1/status")
        except AuthError as exc:
            return _error(start, 401, str(exc), auth.clock_hint(self.key))
        try:
            return self.route(method, path, environ, start)
        except ShardRefused as exc:
            return _error(start, exc.status, exc.reason)
        except Exception:  # a bug must not take the daemon down; the client retries
            log.exception("internal error on %s %s", method, path)
            return _error(start, 500, "internal error; see the worker's log")

    def _signing(self, start: StartResponse, request_id: str) -> StartResponse:
        """``start`` that signs every answer for request ``request_id`` (pipeline.cluster.auth)."""
        def signed_start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            code = int(status.split(" ", 1)[0])
            digest = next((v for k, v in headers if k == auth.RESPONSE_BODY_HEADER), None)
            length = "" if digest is not None else next((v for k, v in headers if k == "Content-Length"), "")
            rest = [(k, v) for k, v in headers if k != auth.RESPONSE_BODY_HEADER]
            return start(status, rest + auth.sign_response(self.key, self.node_id, request_id, code,
                                                           digest or auth.NO_BODY, length), exc_info)
        return signed_start

    def may_prove_for(self, url: str) -> bool:
        """Whether ``url`` (the one a prober dialled) reaches this worker: one of its configured
        URLs, or its own port on an address of this host. A relay's URL is neither."""
        url = url.rstrip("/")
        if url in self.urls:
            return True
        try:
            parts = urlsplit(url)
            port, host = parts.port, parts.hostname
        except ValueError:
            return False
        if not host or port != self.port:
            return False
        if self.host in ("", "0.0.0.0", "::"):
            return own_address(host)
        return _same_address(host, self.host)

    def route(self, method: str, path: str, environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        if path.startswith("/v1/shards/"):
            name = path[len("/v1/shards/"):]
            if not valid_name(name):
                return _error(start, 400, f"shard name {name[:80]!r} is not 64 lowercase hex characters")
            if method == "PUT":
                return self.put(name, environ, start)
            if method in ("GET", "HEAD"):
                return self.get(name, environ, start, head=method == "HEAD")
            if method == "DELETE":
                return _json(start, 200, {"name": name, "deleted": self.store.delete(name)})
            return _error(start, 405, f"{method} not allowed on a shard")
        if path == "/v1/status" and method == "GET":
            count, used = self.store.usage()
            doc = {
                "node_id": self.node_id, "api": API_VERSION, "zone": self.zone,
                "capacity": self.store.capacity_bytes(), "free": self.store.free_bytes(),
                "shards": count, "used": used, "quarantined": len(self.store.quarantined()),
                "filesystem": self.store.filesystem(), "decodes": list(DECODES),
                "zstd": dict(self.wire), "uploads": dict(self.uploads), "pushes": dict(self.pushes),
            }
            nonce = environ.get("HTTP_X_CKPT_NONCE")
            dialled = str(environ.get("HTTP_X_CKPT_URL") or "")[:512]
            if nonce:
                if not self.may_prove_for(dialled):
                    return _error(start, 421, f"{dialled!r} does not reach this storage worker ({self.node_id}); "
                                              "if it is a port forward, start the worker with --url for it")
                doc["proof"] = auth.proof(self.key, self.node_id, dialled, nonce[:128])
            return _json(start, 200, doc)
        if path == "/v1/verify" and method == "POST":
            doc = self._body(environ)
            names = self._names_of(doc)
            rate = doc.get("rate") or 0
            if not isinstance(rate, (int, float)) or rate < 0:
                raise ShardRefused(400, '"rate" must be a non-negative number of bytes per second')
            throttle = Throttle(float(rate))
            results = []
            for name in names:
                failpoints.hit("worker.verify.rehash")
                sha, size = self.store.rehash(name, throttle)
                results.append({"name": name, "sha256": sha, "size": size})
            return _json(start, 200, {"results": results})
        if path == "/v1/push" and method == "POST":
            doc = self._body(environ)
            names = self._names_of(doc)
            if len(names) != 1:
                raise ShardRefused(400, "a push names one shard")
            url, headers, size = push.check(doc)
            answer = push.push(self.store, names[0], url, headers, size)
            if answer.get("status") in (200, 201):
                with self._wire_lock:
                    self.pushes.update({"shards": 1, "bytes": size})
            return _json(start, 200, {"push": answer})
        if path == "/v1/quarantine" and method == "POST":
            names = self._names(environ)
            return _json(start, 200, {"moved": {n: self.store.quarantine_shard(n) is not None for n in names}})
        if path == "/v1/quarantine/purge" and method == "POST":
            names = self._names(environ)
            return _json(start, 200, {"purged": {n: self.store.purge_quarantined(n) for n in names}})
        if path == "/v1/stat" and method == "POST":
            names = self._names(environ)
            return _json(start, 200, {"sizes": {n: self.store.has(n) for n in names}})
        if path == "/v1/delete" and method == "POST":
            names = self._names(environ)
            return _json(start, 200, {"deleted": {n: self.store.delete(n) for n in names}})
        if path == "/v1/inventory" and method == "GET":
            query = parse_qs(environ.get("QUERY_STRING", ""))
            if "limit" in query or "after" in query:
                after = query.get("after", [""])[0]
                try:
                    limit = int(query.get("limit", ["1000"])[0])
                except ValueError:
                    raise ShardRefused(400, "limit must be a whole number") from None
                if (after and not valid_name(after)) or not 0 < limit <= MAX_NAMES:
                    raise ShardRefused(400, f"after must be a shard name and 0 < limit <= {MAX_NAMES}")
                return _json(start, 200, {"shards": [[n, s] for n, s in self.store.inventory_page(after, limit)]})
            return _json(start, 200, {"shards": [[n, s] for n, s in self.store.inventory()],
                                      "quarantined": self.store.quarantined()})
        return _error(start, 404, f"no such endpoint: {method} {path}")

    def put(self, name: str, environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        # A compressed body (pipeline/cluster/wire.py) is chunked; its codec and raw length are
        # in the signed query, and it is bounded like a plain one before anything is read.
        named = [c for c in (PLANES, ZSTD) if c in query]
        if len(named) > 1:
            return _error(start, 400, "planes and zstd: a body is frames of one codec")
        codec = named[0] if named else None
        raw_len = query[codec][0] if codec else environ.get("CONTENT_LENGTH") or ""
        if not raw_len.isdigit() or len(raw_len) > 18:
            if codec:
                return _error(start, 400, f"{codec}: {raw_len[:40]!r} is not a length in bytes")
            return _error(start, 411, "Content-Length is required")
        if self.max_upload and int(raw_len) > self.max_upload:
            return _error(start, 413, f"upload of {int(raw_len):,} bytes exceeds this worker's limit of "
                                      f"{self.max_upload:,} (CKPT_WORKER_MAX_UPLOAD)")
        hops = chain.parse_next(environ.get("QUERY_STRING", ""))
        reached: list[dict[str, Any]] = []
        if hops:
            if any(node == self.node_id for node, _url in hops):
                raise ShardRefused(400, f"next: names this worker ({self.node_id}) again")
            result, reached, wire = chain.put_and_forward(
                self.store, self.key, name, environ["wsgi.input"], int(raw_len), hops, codec=codec,
                stall=chain.parse_stall(environ.get("QUERY_STRING", "")))
            if codec:
                self.count_wire("received", int(raw_len), wire)
        elif codec:
            body = decoding(codec, environ["wsgi.input"], int(raw_len))
            result = self.store.put(name, cast(BinaryIO, body), int(raw_len))
            body.finish()
            self.count_wire("received", int(raw_len), body.wire)
        else:
            result = self.store.put(name, environ["wsgi.input"], int(raw_len))
        with self._wire_lock:
            self.uploads.update({"shards": 1, "bytes": int(raw_len)})
        status = 201 if result.created else 200
        return _json(start, status, {"name": name, "size": result.size, "created": result.created,
                                     "already_present": not result.created, "chain": reached})

    def get(self, name: str, environ: dict[str, Any], start: StartResponse, *, head: bool) -> Iterable[bytes]:
        try:
            f = open(self.store.path(name), "rb")
        except FileNotFoundError:
            if head:
                start("404 Not Found", [("Content-Length", "0")])
                return []
            return _error(start, 404, f"shard {name} is not held here")
        size = os.fstat(f.fileno()).st_size
        if not head:  # the disk reads ahead the whole shard while the first blocks are sent
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        if not head and parse_qs(environ.get("QUERY_STRING", "")).get("zstd") == ["1"] and (
                self.compress == "on" or self.compress == "auto" and CPU.idle() >= MIN_IDLE):
            # Frames, chunked (no Content-Length): the reader knows the shard's size. Asked, not
            # ordered: with no cores to spare this worker answers plain. In the codec the client
            # accepts: one of the previous release names none, and reads zstd frames.
            codec = accepted(str(environ.get("HTTP_ACCEPT") or ""))
            start("200 OK", [("Content-Type", CONTENT_TYPES[codec]), ("X-Ckpt-Size", str(size))])
            self.count_wire("sent", 0, 0)
            return file_frames(f, lambda raw, wire: self.count_wire("sent", raw, wire, shards=0), codec)
        start("200 OK", [("Content-Type", "application/octet-stream"), ("Content-Length", str(size))])
        if head:
            f.close()
            return [b""]
        wrapper = environ.get("wsgi.file_wrapper")
        if wrapper is not None:
            return wrapper(f, 1024 * 1024)
        return _iter_file(f)

    def _body(self, environ: dict[str, Any]) -> dict[str, Any]:
        raw_len = environ.get("CONTENT_LENGTH") or ""
        if not raw_len.isdigit():
            raise ShardRefused(411, "Content-Length is required")
        n = int(raw_len)
        if n > MAX_JSON_BODY:
            raise ShardRefused(413, f"JSON body of {n:,} bytes exceeds {MAX_JSON_BODY:,}")
        raw = environ["wsgi.input"].read(n)
        if auth.body_digest(raw) != environ.get("ckpt.body_digest"):
            raise ShardRefused(401, "the request body is not the one that was signed")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: hostile nesting
            raise ShardRefused(400, 'body must be JSON {"shards": [sha256, ...]}') from None
        if not isinstance(doc, dict):
            raise ShardRefused(400, 'body must be JSON {"shards": [sha256, ...]}')
        return doc

    def _names(self, environ: dict[str, Any]) -> list[str]:
        return self._names_of(self._body(environ))

    @staticmethod
    def _names_of(doc: dict[str, Any]) -> list[str]:
        names = doc.get("shards")
        if not isinstance(names, list) or len(names) > MAX_NAMES:
            raise ShardRefused(400, f'"shards" must be a list of at most {MAX_NAMES} names')
        bad = [n for n in names if not isinstance(n, str) or not valid_name(n)]
        if bad:
            raise ShardRefused(400, f"shard name {str(bad[0])[:80]!r} is not 64 lowercase hex characters")
        return names


def _addresses(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


def _same_address(host: str, bound: str) -> bool:
    """Whether ``host`` names the address this worker is bound to."""
    return bool(_addresses(host) & _addresses(bound))


def _iter_file(f: Any) -> Iterable[bytes]:
    with f:
        while chunk := f.read(1024 * 1024):
            yield chunk
