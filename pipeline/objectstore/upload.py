"""Putting a shard into an object store: one PUT, or a resumable multipart upload.

Every request carries the SHA-256 of its bytes as ``x-amz-checksum-sha256`` and the store
refuses bytes that do not match it (BadDigest). A PUT's checksum is the shard's own name, so the
store itself proves the name; nothing is hashed here. A multipart upload sends each part's
SHA-256 (the store keeps the composite, pipeline/objectstore/keys.py) while this process hashes
the whole source once, in order, beside the parts: a source that is not the bytes its name says
is refused (ObjectMismatch) and its upload aborted, never completed.

An interrupted multipart upload (a crash, a partition, a step that timed out) is continued, not
restarted: the store's list of uploads in progress for the key gives its id, its list of parts
which parts it has (a part of the expected size is kept; when the store lists part checksums,
only if it matches), and only the others are sent. CompleteMultipartUpload names every part with
its SHA-256, which the store checks against what it holds: a part that does not match fails the
completion (BadDigest), and the upload is aborted so that the next attempt starts clean.
"""
from __future__ import annotations

import hashlib
import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import failpoints
from pipeline.errors import ObjectMismatch
from pipeline.objectstore import keys

if TYPE_CHECKING:
    from pipeline.objectstore.client import ObjectStore, Stored

BLOCK = 1024 * 1024


class Source:
    """The bytes of a shard: ``head`` (a safetensors shard's own header, built in memory) then
    ``length`` bytes of an open file from ``offset``, read by position (many parts at once)."""

    def __init__(self, fd: int, offset: int, length: int, head: bytes = b"") -> None:
        self.fd, self.offset, self.length, self.head = fd, offset, length, head
        self.size = len(head) + length

    def pread(self, n: int, at: int) -> bytes:
        if at < len(self.head):
            return self.head[at:at + n]
        data = os.pread(self.fd, min(n, self.size - at), self.offset + at - len(self.head))
        if not data and at < self.size:
            raise ObjectMismatch("source", f"the source ended {self.size - at} bytes early (truncated while sent?)")
        return data


class FileRange(io.RawIOBase):
    """``length`` bytes of a :class:`Source` from ``start``, as a seekable body botocore can send
    and rewind for a retry."""

    def __init__(self, src: Source, start: int, length: int) -> None:
        super().__init__()
        self.src, self.start, self.length, self.pos = src, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self.length

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(0, base + pos), self.length)
        return self.pos

    def read(self, size: int | None = -1) -> bytes:
        left = self.length - self.pos
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        data = self.src.pread(n, self.start + self.pos)
        self.pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def sha256_of(src: Source, start: int, length: int) -> bytes:
    h = hashlib.sha256()
    body = FileRange(src, start, length)
    while chunk := body.read(BLOCK):
        h.update(chunk)
    return h.digest()


def put(store: ObjectStore, sha256: str, source: Path, *, offset: int = 0, length: int | None = None,
        head: bytes = b"") -> Stored:
    from pipeline.objectstore.client import Stored

    fd = os.open(source, os.O_RDONLY)
    try:
        src = Source(fd, offset, os.fstat(fd).st_size - offset if length is None else length, head)
        size = src.size
        key = store.key(sha256)
        t = store.target
        if size <= t.multipart_threshold:
            store.call(f"put of {key}", store.s3.put_object, Bucket=t.bucket, Key=key, Body=FileRange(src, 0, size),
                       ContentLength=size, ChecksumSHA256=keys.full_checksum(sha256), **store.sse_args())
            return Stored(key, size, keys.full_checksum(sha256))
        return Stored(key, size, _multipart(store, sha256, key, src))
    finally:
        os.close(fd)


def _find_upload(store: ObjectStore, key: str) -> tuple[str | None, dict[int, dict[str, Any]]]:
    """The newest upload in progress for ``key`` and the parts the store has of it."""
    t = store.target
    ups: list[dict[str, Any]] = []
    kw: dict[str, Any] = {"Bucket": t.bucket, "Prefix": key}
    while True:
        page = store.call(f"uploads in progress of {key}", store.s3.list_multipart_uploads, **kw)
        ups += [u for u in page.get("Uploads", []) if u["Key"] == key]
        if not page.get("IsTruncated"):
            break
        kw.update(KeyMarker=page.get("NextKeyMarker", ""), UploadIdMarker=page.get("NextUploadIdMarker", ""))
    if not ups:
        return None, {}
    upload_id = str(max(ups, key=lambda u: str(u.get("Initiated", "")))["UploadId"])
    parts: dict[int, dict[str, Any]] = {}
    kw = {"Bucket": t.bucket, "Key": key, "UploadId": upload_id}
    while True:
        page = store.call(f"parts of {key}", store.s3.list_parts, **kw)
        parts.update({int(p["PartNumber"]): p for p in page.get("Parts", [])})
        if not page.get("IsTruncated"):
            break
        kw["PartNumberMarker"] = page["NextPartNumberMarker"]
    return upload_id, parts


def _multipart(store: ObjectStore, sha256: str, key: str, src: Source) -> str:
    t = store.target
    size = src.size
    upload_id, have = _find_upload(store, key)
    if upload_id is None:
        created = store.call(f"multipart upload of {key}", store.s3.create_multipart_upload, Bucket=t.bucket,
                             Key=key, ChecksumAlgorithm="SHA256", **store.sse_args())
        upload_id = str(created["UploadId"])
    part = keys.part_size_for(size, t.part_size)
    spans = keys.ranges(size, part)

    def send(n: int, at: int, length: int) -> tuple[str, bytes]:
        digest = sha256_of(src, at, length)
        held = have.get(n)
        if held and int(held["Size"]) == length and held.get("ChecksumSHA256") in (None, keys.b64(digest)):
            return str(held["ETag"]), digest  # sent before an interruption: kept (the completion checks it)
        r = store.call(f"part {n} of {key}", store.s3.upload_part, Bucket=t.bucket, Key=key, UploadId=upload_id,
                       PartNumber=n, Body=FileRange(src, at, length), ContentLength=length,
                       ChecksumSHA256=keys.b64(digest))
        failpoints.hit("objectstore.part_sent")
        return str(r["ETag"]), digest

    with ThreadPoolExecutor(max_workers=t.concurrency, thread_name_prefix="ckpt-s3-put") as pool:
        futures: list[Future[tuple[str, bytes]]] = [pool.submit(send, n, at, length)
                                                    for n, (at, length) in enumerate(spans, 1)]
        # The whole source, once and in order, beside the parts (which read it from the page cache).
        whole = sha256_of(src, 0, size).hex()
        try:
            done = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    if whole != sha256:
        _abort(store, key, upload_id)
        raise ObjectMismatch(t.name, f"put of {key}: the source's SHA-256 is {whole[:16]}..., not its name")
    parts = [{"PartNumber": n, "ETag": etag, "ChecksumSHA256": keys.b64(digest)}
             for n, (etag, digest) in enumerate(done, 1)]
    try:
        r = store.call(f"completion of {key}", store.s3.complete_multipart_upload, Bucket=t.bucket, Key=key,
                       UploadId=upload_id, MultipartUpload={"Parts": parts})
    except ObjectMismatch:
        _abort(store, key, upload_id)  # a kept part did not match: the next attempt starts clean
        raise
    expected = keys.composite(d for _, d in done)
    got = r.get("ChecksumSHA256")
    if got and got != expected:
        raise ObjectMismatch(t.name, f"put of {key}: the store completed it with checksum {got}, expected {expected}")
    return expected


def _abort(store: ObjectStore, key: str, upload_id: str) -> None:
    store.call(f"abort of {key}", store.s3.abort_multipart_upload, Bucket=store.target.bucket, Key=key,
               UploadId=upload_id)
