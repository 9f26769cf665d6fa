"""Request signing with the cluster key (DESIGN invariant 5).

Every request to a storage worker carries ``X-Ckpt-Time`` (Unix seconds) and
``X-Ckpt-Signature`` = hex HMAC-SHA256(key, "METHOD\\nPATH\\nTIME"). The worker refuses
a bad signature and a timestamp outside the clock-skew bound. Bodies need no MAC:
a shard's name is its SHA-256, and the worker checks it before the shard is visible.
"""
from __future__ import annotations

import hashlib
import hmac
import time

from pipeline.errors import AuthError

TIME_HEADER = "X-Ckpt-Time"
SIGNATURE_HEADER = "X-Ckpt-Signature"


def signature(key: bytes, method: str, path: str, timestamp: str) -> str:
    msg = f"{method.upper()}\n{path}\n{timestamp}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, now: float | None = None) -> dict[str, str]:
    """Headers that authenticate ``method path`` now."""
    ts = str(int(time.time() if now is None else now))
    return {TIME_HEADER: ts, SIGNATURE_HEADER: signature(key, method, path, ts)}


def check(key: bytes, method: str, path: str, timestamp: str | None, sig: str | None,
          max_skew: float, now: float | None = None) -> None:
    """Raise :class:`AuthError` unless the signature is valid and fresh."""
    if not timestamp or not sig:
        raise AuthError("missing X-Ckpt-Time or X-Ckpt-Signature header")
    try:
        ts = int(timestamp)
    except ValueError:
        raise AuthError("X-Ckpt-Time is not an integer") from None
    now = time.time() if now is None else now
    if abs(now - ts) > max_skew:
        raise AuthError(f"request time is {now - ts:+.0f} s off this worker's clock (bound {max_skew:.0f} s)")
    if not hmac.compare_digest(signature(key, method, path, timestamp), sig):
        raise AuthError("signature does not match: wrong cluster key?")


def proof(key: bytes, node_id: str, nonce: str) -> str:
    """What a storage worker answers to a nonce to show it holds the cluster key."""
    return hmac.new(key, f"proof\n{node_id}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def check_proof(key: bytes, node_id: str, nonce: str, answer: str | None) -> bool:
    return bool(answer) and hmac.compare_digest(proof(key, node_id, nonce), str(answer))
