"""Request signing with the cluster key (docs/design.md, invariant 5).

Every request to a storage worker carries ``X-Ckpt-Time`` (Unix seconds), ``X-Ckpt-Request``
(a random id, never used twice), ``X-Ckpt-Body`` (the SHA-256 of a JSON body, or ``-``) and
``X-Ckpt-Signature`` = hex HMAC-SHA256(key, "METHOD\nPATH\nTIME\nREQUEST\nBODY"). The
worker refuses a bad signature, a timestamp outside the clock-skew bound, a request id it
has already seen within that bound (a replay), and a JSON body that is not the one signed.
Shard bodies are not hashed here: a shard's name is its SHA-256, and the worker checks it
before the shard is visible.
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
NO_BODY = "-"


def wall() -> float:
    """This process's wall clock, as signatures use it (skewed only by fault tests)."""
    return time.time() + failpoints.clock_offset()


def signature(key: bytes, method: str, path: str, timestamp: str, request_id: str, body: str) -> str:
    msg = f"{method.upper()}\n{path}\n{timestamp}\n{request_id}\n{body}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def body_digest(body: bytes | None) -> str:
    return hashlib.sha256(body).hexdigest() if body is not None else NO_BODY


def sign(key: bytes, method: str, path: str, body: bytes | None = None, now: float | None = None,
         request_id: str | None = None) -> dict[str, str]:
    """Headers that authenticate ``method path`` (and ``body``, a JSON body) once, now."""
    ts = str(int(wall() if now is None else now))
    rid = request_id or secrets.token_hex(16)
    digest = body_digest(body)
    return {TIME_HEADER: ts, REQUEST_HEADER: rid, BODY_HEADER: digest,
            SIGNATURE_HEADER: signature(key, method, path, ts, rid, digest)}


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


def check(key: bytes, method: str, path: str, headers: dict[str, str | None], max_skew: float,
          replay: ReplayGuard | None = None, now: float | None = None) -> str:
    """Raise :class:`AuthError` unless the request is signed, fresh and not a replay.

    ``headers`` maps the four header names to their values. Returns the signed body digest
    (:data:`NO_BODY` or the SHA-256 the JSON body must have).
    """
    timestamp, rid, digest, sig = (headers.get(h) for h in (TIME_HEADER, REQUEST_HEADER, BODY_HEADER,
                                                             SIGNATURE_HEADER))
    if not timestamp or not sig or not rid or not digest:
        raise AuthError(f"missing {TIME_HEADER}, {REQUEST_HEADER}, {BODY_HEADER} or {SIGNATURE_HEADER} header")
    if len(rid) > 64 or len(digest) > 64:
        raise AuthError("malformed request id or body digest")
    try:
        ts = int(timestamp)
    except ValueError:
        raise AuthError(f"{TIME_HEADER} is not an integer") from None
    now = wall() if now is None else now
    if abs(now - ts) > max_skew:
        raise AuthError(f"request time is {now - ts:+.0f} s off this worker's clock (bound {max_skew:.0f} s)")
    if not hmac.compare_digest(signature(key, method, path, timestamp, rid, digest), sig):
        raise AuthError("signature does not match: wrong cluster key?")
    if replay is not None and not replay.first_use(rid, now):
        raise AuthError("replayed request: this request id was already used")
    return digest


def proof(key: bytes, node_id: str, nonce: str) -> str:
    """What a storage worker answers to a nonce to show it holds the cluster key."""
    return hmac.new(key, f"proof\n{node_id}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def check_proof(key: bytes, node_id: str, nonce: str, answer: str | None) -> bool:
    return bool(answer) and hmac.compare_digest(proof(key, node_id, nonce), str(answer))


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
    if not hmac.compare_digest(good, sig):
        return None
    try:
        return float(ts)
    except ValueError:
        return None
