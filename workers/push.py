"""A worker's copy put on an object store by the worker itself (``POST /v1/push``).

The control plane, which holds the store's credentials, presigns one PUT of the shard's object
(pipeline/objectstore/client.py ``presign_put``): a URL valid for minutes, for one key, with the
shard's SHA-256 as a signed ``x-amz-checksum-sha256`` header, so the store refuses any other
bytes (BadDigest) and the worker needs no credential. The worker streams its file there: the
trainer's host sent the bytes once, to the first worker; the object store's copy is made from
the workers' side (docs/design.md, "Object-store targets").

Only ``http``/``https`` URLs; only ``x-amz-*`` and ``Content-Type`` headers are passed on (the
URL's host is the request's ``Host``); the answer is the store's status, its checksum header and
the start of an error body, for the control plane to judge (it confirms the object by HEAD).
"""
from __future__ import annotations

import http.client
import os
import re
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import ShardRefused
from workers.shardstore import ShardStore

BLOCK = 1024 * 1024
#: Seconds without progress before a push is given up (the store stopped reading or answering).
STALL = 60.0


def check(doc: dict[str, Any]) -> tuple[str, dict[str, str], int]:
    """The push's URL, headers and expected size, or a 400 naming what is wrong."""
    url, headers, size = doc.get("url"), doc.get("headers") or {}, doc.get("size")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        raise ShardRefused(400, '"url" must be an http or https URL')
    if not isinstance(headers, dict) or not all(_passed_on(k, v) for k, v in headers.items()):
        raise ShardRefused(400, '"headers" may hold only x-amz-* and Content-Type headers, as strings')
    if not isinstance(size, int) or size < 0:
        raise ShardRefused(400, '"size" must be the shard\'s size in bytes')
    return url, headers, size


def _passed_on(k: object, v: object) -> bool:
    """Whether a header may go on to the store: an x-amz-* or Content-Type string, on one line."""
    if not isinstance(k, str) or not isinstance(v, str) or any(c in v for c in "\r\n\0"):
        return False
    if not re.fullmatch(r"[A-Za-z0-9-]+", k):  # a header name is a token: no ':', no space
        return False
    return k.lower().startswith("x-amz-") or k.lower() == "content-type"


def push(store: ShardStore, name: str, url: str, headers: dict[str, str], size: int,
         stall: float = STALL) -> dict[str, Any]:
    """PUT shard ``name`` to ``url``; what the store answered."""
    try:
        f = open(store.path(name), "rb")
    except FileNotFoundError:
        raise ShardRefused(404, f"shard {name} is not held here") from None
    with f:
        held = os.fstat(f.fileno()).st_size
        if held != size:
            raise ShardRefused(409, f"shard {name} is {held:,} bytes here, not {size:,}")
        parts = urlsplit(url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname or "", parts.port, timeout=stall)
        try:
            conn.putrequest("PUT", parts.path + (f"?{parts.query}" if parts.query else ""), skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.putheader("Content-Length", str(size))
            conn.endheaders()
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while block := f.read(BLOCK):
                conn.send(block)
            resp = conn.getresponse()
            body = resp.read(64 * 1024)
        except (OSError, http.client.HTTPException) as exc:
            return {"status": None, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            conn.close()
    answer: dict[str, Any] = {"status": resp.status, "checksum": resp.getheader("x-amz-checksum-sha256")}
    if resp.status >= 300:
        answer["error"] = body[:500].decode("utf-8", "replace")
    return answer
