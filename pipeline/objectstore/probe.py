"""Does a target work, now, with the credentials this process finds? (``ckpt target add``.)

The bucket must answer (HeadBucket); then, unless only reading, a small probe object goes through
the contract a copy uses: put with its SHA-256 sent as ``x-amz-checksum-sha256``, confirmed by
the checksum the store keeps, deleted. That proves the credentials may write and delete there and
that the store keeps SHA-256 checksums, without which no copy could be confirmed. The probe is
random bytes, so its key (content addressed) is no shard's: deleting it never touches a copy.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ObjectMismatch, StoreCredentials
from pipeline.objectstore.client import ObjectStore

PROBE_BYTES = 64


@dataclass(frozen=True)
class Probe:
    """What a probe proved: the bucket answers; ``written``: a probe object was put, confirmed by
    its SHA-256 and deleted. ``credentials`` says where the credentials came from."""

    written: bool
    credentials: str


def probe(store: ObjectStore, *, write: bool = True) -> Probe:
    """Check ``store``'s bucket answers and (``write``) takes, confirms and deletes an object.
    Raises the ObjectStoreError of what failed, whose message says what to do."""
    t = store.target
    store.call(f"HeadBucket of {t.bucket}", store.s3.head_bucket, Bucket=t.bucket)
    if write:
        data = os.urandom(PROBE_BYTES)
        sha = hashlib.sha256(data).hexdigest()
        with tempfile.TemporaryDirectory(prefix="ckpt-probe-") as tmp:
            path = Path(tmp) / "probe"
            path.write_bytes(data)
            store.put(sha, path)
        try:
            store.confirm(sha, PROBE_BYTES)
        except ObjectMismatch as exc:
            store.delete(sha)
            raise ObjectMismatch(t.name, f"a probe object put with its SHA-256 came back without it ({exc.reason}): "
                                         "the store does not keep x-amz-checksum-sha256 checksums, so no copy "
                                         "there could be confirmed; use a store (or a version of it) that does"
                                         ) from exc
        try:
            store.delete(sha)
        except StoreCredentials as exc:
            raise StoreCredentials(t.name, f"the probe object {store.key(sha)} was written but could not be "
                                           f"deleted: GC needs s3:DeleteObject; delete it by hand ({exc.reason})"
                                   ) from exc
    return Probe(write, store.credentials_source() or "unknown")
