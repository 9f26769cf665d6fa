"""Reading shards back from an object store: into a file (``get``), as a stream read in order
(``Stream``: a restore's source of last resort), and a scrub (``read_back``).

``get`` writes the object into a file with parallel ranged GETs (the target's part size and
concurrency) while this thread hashes the ranges in order as they land (read back from the page
cache), so verification costs no pass after the download. A range whose connection breaks is
fetched again (the target's max_attempts); the SHA-256 of the whole is compared with the name.

``Stream`` reads an object in order for a caller that hashes and writes it as it comes
(pipeline/restoring/gather.py): its ranges are fetched ahead in parallel, at most ``READ_AHEAD``
bytes of them held at once, so a restore of many shards at once stays within a bounded memory.

``read_back`` reads at a bounded rate, one range at a time: all of the object (its SHA-256
checked) or a sample of its ranges, the first and the last always (readable and whole, its
length as recorded: a truncated object fails).
"""
from __future__ import annotations

import hashlib
import math
import os
import random
import re
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import ObjectMismatch, StoreUnreachable
from pipeline.objectstore import keys
from pipeline.objectstore.upload import BLOCK

if TYPE_CHECKING:
    from pipeline.objectstore.client import ObjectStore

CHUNK = 1024 * 1024
#: Bytes of ranges a :class:`Stream` fetches ahead of its reader (a 64 MiB shard in 8 MiB parts:
#: four GETs at once, 32 MiB held).
READ_AHEAD = 32 * 1024 * 1024


def fetch(store: ObjectStore, key: str, at: int, length: int, size: int, sink: Callable[[int, bytes], None]) -> None:
    """GET ``length`` bytes at ``at`` of an object of ``size`` bytes, each chunk to ``sink(offset,
    data)``; a broken connection is tried again, up to the target's max_attempts."""
    if length == 0:
        return
    t = store.target
    for attempt in range(1, t.max_attempts + 1):
        done = 0
        try:
            r = store.call(f"get of {key} bytes {at}-{at + length - 1}", store.s3.get_object, Bucket=t.bucket,
                           Key=key, Range=f"bytes={at}-{at + length - 1}")
            total = _total(r)
            if total is not None and total != size:
                raise ObjectMismatch(t.name, f"get of {key}: the store holds {total} bytes, expected {size}")
            body = r["Body"]
            while done < length:
                data = store.call(f"get of {key}", body.read, amt=min(CHUNK, length - done))
                if not data:
                    break
                sink(at + done, data)
                done += len(data)
            if done != length:
                raise ObjectMismatch(t.name, f"get of {key}: {done} of {length} bytes at {at} (truncated)")
            return
        except StoreUnreachable:
            if attempt == t.max_attempts:
                raise
            time.sleep(min(20.0, 0.05 * 2**attempt))


def _total(response: dict[str, Any]) -> int | None:
    m = re.search(r"/(\d+)$", str(response.get("ContentRange") or ""))
    return int(m.group(1)) if m else None


def get(store: ObjectStore, sha256: str, dest: Path, *, size: int | None = None) -> int:
    key = store.key(sha256)
    if size is None:
        size = store.head(sha256).size
    spans = keys.ranges(size, keys.part_size_for(size, store.target.part_size))
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    ok = False
    try:
        def sink(offset: int, data: bytes) -> None:
            os.pwrite(fd, data, offset)

        h = hashlib.sha256()
        with ThreadPoolExecutor(max_workers=store.target.concurrency, thread_name_prefix="ckpt-s3-get") as pool:
            futures: list[Future[None]] = [pool.submit(fetch, store, key, at, length, size, sink)
                                           for at, length in spans]
            try:
                buf = bytearray(BLOCK)
                view = memoryview(buf)
                for f, (at, length) in zip(futures, spans, strict=True):
                    f.result()
                    for o in range(at, at + length, BLOCK):
                        n = os.preadv(fd, [view[:min(BLOCK, at + length - o)]], o)
                        h.update(view[:n])
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        if h.hexdigest() != sha256:
            raise ObjectMismatch(store.target.name, f"get of {key}: the bytes hash to {h.hexdigest()[:16]}..., "
                                                    "not their name (tampered with, or damaged in the store)")
        ok = True
        return size
    finally:
        os.close(fd)
        if not ok:
            dest.unlink(missing_ok=True)


class Stream:
    """The object named ``sha256`` (``size`` bytes) read in order with :meth:`readinto`, as a
    storage worker's answer is: its ranges (the target's part size) are fetched ahead in
    parallel, up to ``READ_AHEAD`` bytes of them. A failure (ObjectStoreError: a range the
    store would not give, or an object of another size) is raised by the read that reaches it.
    Nothing here checks the SHA-256: the reader hashes what it takes."""

    def __init__(self, store: ObjectStore, sha256: str, size: int) -> None:
        self.store, self.key, self.size = store, store.key(sha256), size
        part = keys.part_size_for(size, store.target.part_size)
        self._spans = deque(keys.ranges(size, part))
        window = max(1, min(store.target.concurrency, READ_AHEAD // part))
        self._pool = ThreadPoolExecutor(max_workers=window, thread_name_prefix="ckpt-s3-read")
        self._ahead: deque[Future[bytearray]] = deque()
        self._current, self._at = memoryview(b""), 0
        if size == 0:  # no range to ask: the object must still be there, and empty
            got = store.head(sha256).size
            if got != 0:
                raise ObjectMismatch(store.target.name, f"get of {self.key}: {got} bytes, expected 0")
        for _ in range(window):
            self._submit()

    def _submit(self) -> None:
        if self._spans:
            at, length = self._spans.popleft()
            self._ahead.append(self._pool.submit(self._range, at, length))

    def _range(self, at: int, length: int) -> bytearray:
        buf = bytearray(length)

        def sink(offset: int, data: bytes) -> None:  # at its place: a range fetched again overwrites
            buf[offset - at:offset - at + len(data)] = data

        fetch(self.store, self.key, at, length, self.size, sink)
        return buf

    def readinto(self, view: memoryview) -> int:
        """Up to ``len(view)`` of the next bytes into ``view``; 0 at the end of the object."""
        while self._at == len(self._current):
            if not self._ahead:
                return 0
            self._current, self._at = memoryview(self._ahead.popleft().result()), 0
            self._submit()
        n = min(len(view), len(self._current) - self._at)
        view[:n] = self._current[self._at:self._at + n]
        self._at += n
        return n

    def read(self, amt: int) -> bytes:
        """Up to ``amt`` of the next bytes (b"" at the end of the object)."""
        buf = bytearray(amt)
        return bytes(buf[:self.readinto(memoryview(buf))])

    def close(self) -> None:
        """Stop: ranges not started are dropped; one under way ends on its own (the target's
        timeouts bound it), nobody waits for it."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ahead.clear()
        self._current = memoryview(b"")


class Throttle:
    """At most ``rate`` bytes per second on average since it started (0: no limit)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.start, self.bytes = clock(), 0

    def take(self, n: int) -> None:
        """Count ``n`` bytes read; sleep while they are ahead of the rate."""
        self.bytes += n
        if self.rate > 0:
            ahead = self.bytes / self.rate - (self.clock() - self.start)
            if ahead > 0:
                self.sleep(ahead)


def read_back(store: ObjectStore, sha256: str, size: int, *, sample: float = 1.0, rate: float = 0.0,
              seed: int | None = None) -> int:
    if not 0 < sample <= 1:
        raise ValueError(f"sample must be in (0, 1], got {sample}")
    key = store.key(sha256)
    spans = keys.ranges(size, keys.part_size_for(size, store.target.part_size))
    whole = sample >= 1
    if not whole:
        k = max(min(2, len(spans)), math.ceil(sample * len(spans)))
        middle = random.Random(seed).sample(range(1, len(spans) - 1), max(0, k - 2)) if len(spans) > 2 else []
        spans = [spans[i] for i in sorted({0, len(spans) - 1, *middle})]
    if size == 0:
        head = store.head(sha256)
        if head.size != 0:
            raise ObjectMismatch(store.target.name, f"read-back of {key}: {head.size} bytes, expected 0")
    h = hashlib.sha256()
    throttle = Throttle(rate)
    read = 0

    def sink(_offset: int, data: bytes) -> None:
        nonlocal read
        if whole:
            h.update(data)
        read += len(data)
        throttle.take(len(data))

    for at, length in spans:
        fetch(store, key, at, length, size, sink)
    if whole and h.hexdigest() != sha256:
        raise ObjectMismatch(store.target.name, f"read-back of {key}: the bytes hash to {h.hexdigest()[:16]}..., "
                                                "not their name (tampered with, or damaged in the store)")
    return read


__all__ = ["Stream", "get", "read_back"]
