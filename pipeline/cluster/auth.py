"""Request signing with the cluster key (docs/design.md, invariant 5).

Every request to a storage worker carries ``X-Ckpt-Time`` (Unix seconds), ``X-Ckpt-Request``
(a random id, never used twice), ``X-Ckpt-Body`` (the SHA-256 of a JSON body, or ``-``),
``X-Ckpt-Node`` (the node id of the worker it is meant for; ``*`` only for a status probe)
and ``X-Ckpt-Signature`` = hex HMAC-SHA256(key, "METHOD\nPATH\nTIME\nREQUEST\nBODY\nNODE").
The worker refuses a bad signature, a timestamp outside the clock-skew bound, a request id it
has already seen within that bound (a replay), a request meant for another node (a request
captured on its way to one worker is worth nothing at another), and a JSON body that is not
the one signed. Shard bodies are not hashed here: a shard's name is its SHA-256, and the
worker checks it before the shard is visible.

Every answer is signed too: ``X-Ckpt-Responder`` (the worker's node id),
``X-Ckpt-Response-Body`` (the SHA-256 of the body, or ``-`` for a streamed shard) and
``X-Ckpt-Response-Signature`` = HMAC(key, "response\nNODE\nREQUEST\nSTATUS\nBODY\nLENGTH"),
bound to the request it answers. The client accepts no answer (an upload accepted, a re-hash,
a size, an inventory, a 404) that a holder of the key did not sign, from the node it asked.
The admission proof binds the node id, the URL the prober dialled and its nonce; a worker
proves only for a URL that reaches it (docs/design.md, invariant 5).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable

from pipeline import failpoints
from pipeline.errors import AuthError

TIME_HEADER = "X-Ckpt-Time"
REQUEST_HEADER = "X-Ckpt-Request"
BODY_HEADER = "X-Ckpt-Body"
SIGNATURE_HEADER = "X-Ckpt-Signature"
NODE_HEADER = "X-Ckpt-Node"
NONCE_HEADER = "X-Ckpt-Nonce"
URL_HEADER = "X-Ckpt-Url"
RESPONDER_HEADER = "X-Ckpt-Responder"
RESPONSE_BODY_HEADER = "X-Ckpt-Response-Body"
RESPONSE_SIGNATURE_HEADER = "X-Ckpt-Response-Signature"
NO_BODY = "-"
#: The node id a status probe names when it does not know whom it reaches yet.
ANY_NODE = "*"


def wall() -> float:
    """This process's wall clock, as signatures use it (skewed only by fault tests)."""
    return time.time() + failpoints.clock_offset()


def signature(key: bytes, method: str, path: str, timestamp: str, request_id: str, body: str, node: str) -> str:
    msg = f"{method.upper()}\n{path}\n{timestamp}\n{request_id}\n{body}\n{node}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def body_digest(body: bytes | None) -> str:
    return hashlib.sha256(body).hexdigest() if body is not None else NO_BODY


def sign(key: bytes, method: str, path: str, body: bytes | None = None, now: float | None = None,
         request_id: str | None = None, node: str = ANY_NODE) -> dict[str, str]:
    """Headers that authenticate ``method path`` (and ``body``, a JSON body) once, now, for
    the worker ``node``."""
    ts = str(int(wall() if now is None else now))
    rid = request_id or secrets.token_hex(16)
    digest = body_digest(body)
    return {TIME_HEADER: ts, REQUEST_HEADER: rid, BODY_HEADER: digest, NODE_HEADER: node,
            SIGNATURE_HEADER: signature(key, method, path, ts, rid, digest, node)}


class ReplayGuard:
    """Request ids seen within the clock-skew bound; a second use is a replay."""

    def __init__(self, max_skew: float) -> None:
        self.max_skew = max_skew
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next_prune = 0.0

    def first_use(self, request_id: str, now: float) -> bool:
        with self._lock:
            if now >= self._next_prune:  # forget ids whose timestamps can no longer pass the check
                self._seen = {r: t for r, t in self._seen.items() if t > now}
                self._next_prune = now + 10
            if request_id in self._seen:
                return False
            self._seen[request_id] = now + 2 * self.max_skew
            return True


#: The request headers :func:`check` reads.
SIGNED_HEADERS = (TIME_HEADER, REQUEST_HEADER, BODY_HEADER, NODE_HEADER, SIGNATURE_HEADER)


def check(key: bytes, method: str, path: str, headers: dict[str, str | None], max_skew: float,
          replay: ReplayGuard | None = None, now: float | None = None, *, node_id: str,
          any_node: bool = False) -> str:
    """Raise :class:`AuthError` unless the request is signed, fresh, not a replay and meant
    for ``node_id`` (or, with ``any_node``, for any node: a status probe).

    ``headers`` maps :data:`SIGNED_HEADERS` to their values. Returns the signed body digest
    (:data:`NO_BODY` or the SHA-256 the JSON body must have).
    """
    timestamp, rid, digest, node, sig = (headers.get(h) for h in SIGNED_HEADERS)
    if not timestamp or not sig or not rid or not digest or not node:
        raise AuthError(f"missing one of the {', '.join(SIGNED_HEADERS)} headers")
    if len(rid) > 64 or len(digest) > 64 or len(node) > 64:
        raise AuthError("malformed request id, body digest or node id")
    try:
        ts = int(timestamp)
    except ValueError:
        raise AuthError(f"{TIME_HEADER} is not an integer") from None
    now = wall() if now is None else now
    if abs(now - ts) > max_skew:
        raise AuthError(f"request time is {now - ts:+.0f} s off this worker's clock (bound {max_skew:.0f} s)")
    if not hmac.compare_digest(signature(key, method, path, timestamp, rid, digest, node).encode(),
                               sig.encode(errors="replace")):
        raise AuthError("signature does not match: wrong cluster key?")
    if node != node_id and not (any_node and node == ANY_NODE):
        raise AuthError(f"this request is meant for storage worker {node[:64]!r}; this is {node_id}")
    if replay is not None and not replay.first_use(rid, now):
        raise AuthError("replayed request: this request id was already used")
    return digest


def proof(key: bytes, node_id: str, url: str, nonce: str) -> str:
    """What a storage worker answers to a nonce, reached at ``url``, to show it holds the
    cluster key: bound to its node id and to the URL the prober dialled."""
    return hmac.new(key, f"proof\n{node_id}\n{url}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def check_proof(key: bytes, node_id: str, url: str, nonce: str, answer: object) -> bool:
    if not isinstance(answer, str) or not answer.isascii():
        return False
    return hmac.compare_digest(proof(key, node_id, url, nonce), answer)


def response_signature(key: bytes, node_id: str, request_id: str, status: int, body: str, length: str) -> str:
    msg = f"response\n{node_id}\n{request_id}\n{status}\n{body}\n{length}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign_response(key: bytes, node_id: str, request_id: str, status: int, body_digest_: str,
                  length: str = "") -> list[tuple[str, str]]:
    """The headers that authenticate a worker's answer to request ``request_id``: its JSON
    body's digest, or :data:`NO_BODY` and the ``length`` of a streamed shard or a HEAD."""
    return [(RESPONDER_HEADER, node_id), (RESPONSE_BODY_HEADER, body_digest_),
            (RESPONSE_SIGNATURE_HEADER, response_signature(key, node_id, request_id, status, body_digest_, length))]


def check_response(key: bytes, request_id: str, status: int, header: Callable[[str], str | None],
                   body: bytes | None, *, node_id: str, length: str = "", head: bool = False) -> str:
    """Raise :class:`AuthError` unless a holder of the key answered request ``request_id``
    with ``status`` and ``body`` (None: a streamed shard, bound by its ``length``; with
    ``head``, an answer to HEAD, which has no body to compare). Returns the responder's node
    id, which must be ``node_id`` unless that is :data:`ANY_NODE`."""
    responder, digest, sig = (header(h) for h in (RESPONDER_HEADER, RESPONSE_BODY_HEADER,
                                                  RESPONSE_SIGNATURE_HEADER))
    if not responder or not digest or not sig:
        raise AuthError("the answer is not signed: not a storage worker of this cluster")
    if not head and digest != body_digest(body):
        raise AuthError("the answer's body is not the one signed")
    if digest != NO_BODY:
        length = ""  # a JSON answer is bound by its digest
    good = response_signature(key, responder, request_id, status, digest, length)
    if not hmac.compare_digest(good.encode(), sig.encode(errors="replace")):
        raise AuthError("the answer's signature does not match: not signed with this cluster's key")
    if node_id != ANY_NODE and responder != node_id:
        raise AuthError(f"answered by {responder[:64]!r}, not by {node_id}")
    return responder


#: On a 401, the worker tells its clock, signed, so that a client whose clock is off can
#: sign its next requests with the worker's time (requests stay single-use and bound).
SERVER_TIME_HEADER = "X-Ckpt-Server-Time"
SERVER_TIME_SIGNATURE = "X-Ckpt-Server-Time-Signature"


def clock_hint(key: bytes) -> list[tuple[str, str]]:
    ts = f"{wall():.3f}"
    return [(SERVER_TIME_HEADER, ts),
            (SERVER_TIME_SIGNATURE, hmac.new(key, f"time\n{ts}".encode(), hashlib.sha256).hexdigest())]


def read_clock_hint(key: bytes, header: Callable[[str], str | None]) -> float | None:
    """The worker's clock from a 401's headers (``header(name)``), if signed with the key."""
    ts, sig = header(SERVER_TIME_HEADER), header(SERVER_TIME_SIGNATURE)
    if not ts or not sig:
        return None
    good = hmac.new(key, f"time\n{ts}".encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(good.encode(), sig.encode(errors="replace")):  # a non-ASCII str would raise
        return None
    try:
        return float(ts)
    except ValueError:
        return None
