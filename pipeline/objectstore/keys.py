"""Content-addressed object keys and the checksums S3 keeps for them (pure).

A shard is stored under ``<prefix>/<sha256[:2]>/<sha256>``, so the same bytes have one key
wherever they came from (deduplication) and an inventory names the shards it holds (GC).

S3 keeps one SHA-256 checksum per object (``x-amz-checksum-sha256``, base64). For an object sent
in one PUT it is the object's own SHA-256 (type FULL_OBJECT). For a multipart upload S3 has no
full-object SHA-256: it keeps a COMPOSITE one, the SHA-256 of the concatenated part digests,
suffixed ``-<parts>``; it depends on the part size, so :func:`composite` recomputes it from the
part digests the upload sent.
"""
from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable

#: S3's limits on a multipart upload.
MAX_PARTS = 10_000
MIN_PART = 5 * 1024 * 1024
_SHA = re.compile(r"[0-9a-f]{64}")


def key_for(prefix: str, sha256: str) -> str:
    """The key of the object holding the bytes named ``sha256``."""
    if not _SHA.fullmatch(sha256):
        raise ValueError(f"not a lowercase hex SHA-256: {sha256!r}")
    return f"{prefix}/{sha256[:2]}/{sha256}" if prefix else f"{sha256[:2]}/{sha256}"


def sha_of(prefix: str, key: str) -> str | None:
    """The SHA-256 a key of this layout names, or None for any other key (not ours)."""
    rest = key[len(prefix) + 1:] if prefix else key
    if prefix and not key.startswith(prefix + "/"):
        return None
    head, _, sha = rest.partition("/")
    return sha if _SHA.fullmatch(sha) and head == sha[:2] else None


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def full_checksum(sha256: str) -> str:
    """The ``ChecksumSHA256`` of an object sent in one PUT: its own SHA-256, base64."""
    return b64(bytes.fromhex(sha256))


def composite(part_digests: Iterable[bytes]) -> str:
    """The ``ChecksumSHA256`` S3 keeps for a multipart upload of parts with these digests."""
    digests = list(part_digests)
    return f"{b64(hashlib.sha256(b''.join(digests)).digest())}-{len(digests)}"


def is_composite(checksum: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9+/]{43}=-\d+", checksum) is not None


def part_size_for(size: int, part_size: int) -> int:
    """``part_size``, raised to a whole MiB as needed so that ``size`` fits in MAX_PARTS parts."""
    need = -(-size // MAX_PARTS)
    if need <= part_size:
        return max(part_size, MIN_PART)
    mib = 1024 * 1024
    return -(-need // mib) * mib


def ranges(size: int, part: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each part of an object of ``size`` bytes (one empty part for 0)."""
    if size == 0:
        return [(0, 0)]
    return [(o, min(part, size - o)) for o in range(0, size, part)]
