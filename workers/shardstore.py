"""A content-addressed shard store on one directory.

Layout: ``<data>/shards/ab/cd/<sha256>`` for shards, ``<data>/tmp/`` for uploads in
flight, ``<data>/quarantine/`` for copies set aside. A shard becomes visible only after
its bytes hashed to its name, were fsynced, renamed into place, and the directory
fsynced (docs/design.md, invariant 2).
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from pipeline import failpoints
from pipeline.durable import WriteBehind, fsync_dir
from pipeline.errors import ShardRefused

SHARD_NAME = re.compile(r"^[0-9a-f]{64}$")
BLOCK = 4 * 1024 * 1024
NET_BLOCK = 1024 * 1024


def machine_id() -> str:
    """This kernel's identity: its boot id (containers on one host share it, as they share its
    device numbers), else the machine id, else the hostname."""
    for source in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(source) as f:
                found = f.read().strip()
        except OSError:
            continue
        if found:
            return found
    import socket

    return socket.gethostname()


def filesystem_id(path: str) -> str:
    """Who holds ``path``'s filesystem: the kernel (:func:`machine_id`; a device number is only
    unique on one host), the device number and statvfs's filesystem id."""
    fsid = getattr(os.statvfs(path), "f_fsid", 0)
    return f"{machine_id()}:{os.stat(path).st_dev}:{fsid}"


def valid_name(name: str) -> bool:
    return bool(SHARD_NAME.match(name))


@dataclass(frozen=True)
class PutResult:
    created: bool
    size: int


class ShardStore:
    """Shards of one worker. ``capacity`` (bytes, 0: the whole disk) caps what the shards may
    use: an operator gives the pipeline a share of a disk others use too."""

    def __init__(self, root: str | os.PathLike[str], *, capacity: int = 0) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.shards = os.path.join(self.root, "shards")
        self.tmp = os.path.join(self.root, "tmp")
        self.quarantine = os.path.join(self.root, "quarantine")
        for d in (self.shards, self.tmp, self.quarantine):
            os.makedirs(d, exist_ok=True)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._count = self._used = 0
        self.reopen()

    def reopen(self) -> None:
        """Drop the leftovers of uploads a crash interrupted (never visible) and count the shards;
        from then on the counts are kept up to date: a status answer never walks the store.

        Also run in each server process before it serves (workers.server): it is forked from the
        one that opened the store, and one respawned after its predecessor was killed would
        otherwise start from the counts of when the server started; a deletion then took
        ``used`` below zero, and the worker's status was refused as malformed (taken for down).
        """
        for name in os.listdir(self.tmp):
            os.unlink(os.path.join(self.tmp, name))
        count = used = 0
        for _name, size in self.inventory():
            count, used = count + 1, used + size
        with self._lock:
            self._count, self._used = count, used

    def _counted(self, count: int, size: int) -> None:
        with self._lock:
            self._count, self._used = self._count + count, self._used + size

    def path(self, name: str) -> str:
        if not valid_name(name):
            raise ShardRefused(400, f"shard name {name[:80]!r} is not 64 lowercase hex characters")
        return os.path.join(self.shards, name[:2], name[2:4], name)

    def has(self, name: str) -> int | None:
        """Size of the shard if present."""
        try:
            return os.stat(self.path(name)).st_size
        except FileNotFoundError:
            return None

    def free_bytes(self) -> int:
        free = shutil.disk_usage(self.root).free
        return max(0, min(free, self.capacity - self.usage()[1])) if self.capacity else free

    def capacity_bytes(self) -> int:
        return self.capacity or shutil.disk_usage(self.root).total

    def filesystem(self) -> dict[str, int | str]:
        """The filesystem the shards are on: an identity the same for every worker on it
        (:func:`filesystem_id`), its size and its free bytes. Several workers on one disk (``ckpt
        up`` runs three) report one filesystem, and the cluster counts its capacity once."""
        usage = shutil.disk_usage(self.root)
        return {"id": filesystem_id(self.root), "capacity": usage.total, "free": usage.free}

    def put(self, name: str, body: BinaryIO, length: int) -> PutResult:
        """Store ``length`` bytes read from ``body`` as shard ``name``.

        The bytes stream to a temporary file while being hashed; a mismatch is refused
        before anything becomes visible.
        """
        final = self.path(name)
        if os.path.exists(final):
            _drain(body, length)
            return PutResult(created=False, size=os.stat(final).st_size)
        if length < 0:
            raise ShardRefused(411, "Content-Length is required")
        free = self.free_bytes()
        if length > free:
            raise ShardRefused(507, f"shard of {length:,} bytes exceeds the {free:,} bytes free")
        h = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=name[:16] + ".")
        try:
            # Small network reads: the server's body reader makes several temporary copies
            # of each read, and with many uploads in flight big ones pile up in the heap.
            buf = bytearray(min(NET_BLOCK, max(length, 1)))
            view = memoryview(buf)
            remaining = length
            with os.fdopen(fd, "wb", buffering=0) as out:
                behind = WriteBehind(out.fileno())
                while remaining:
                    n = body.readinto(view[: min(len(buf), remaining)]) if hasattr(body, "readinto") else None
                    if n is None:
                        chunk = body.read(min(len(buf), remaining))
                        n = len(chunk)
                        view[:n] = chunk
                    if not n:
                        raise ShardRefused(400, f"body ended after {length - remaining:,} of {length:,} bytes")
                    h.update(view[:n])
                    failpoints.hit("worker.put.write")
                    out.write(view[:n])
                    remaining -= n
                    behind.written(length - remaining)
                actual = h.hexdigest()
                if actual != name:
                    raise ShardRefused(422, f"body hashes to {actual}, not to its name {name}")
                failpoints.hit("worker.put.fsync")
                os.fsync(out.fileno())
                # Nothing reads a new shard from the cache (verify and scrub drop it first):
                # leave the memory to the next uploads.
                os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            try:
                # A link, not a rename: of two uploads of one name, exactly one creates it.
                os.link(tmp, final)
            except FileExistsError:
                return PutResult(created=False, size=os.stat(final).st_size)
            self._counted(1, length)
            failpoints.hit("worker.put.renamed")  # visible, not yet answered
            fsync_dir(os.path.dirname(final))
            return PutResult(created=True, size=length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ShardRefused(507, f"no space left on this worker's disk ({exc.strerror})") from None
            raise
        finally:
            if tmp:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def rehash(self, name: str, throttle: Throttle | None = None) -> tuple[str | None, int | None]:
        """``(sha256, size)`` of the shard as it is on the disk now, or ``(None, None)`` if absent.

        The page cache is dropped first so the bytes come from the disk, not memory;
        ``throttle`` bounds the read rate (scrubs must not starve training I/O).
        """
        try:
            f = open(self.path(name), "rb", buffering=0)
        except FileNotFoundError:
            return None, None
        with f:
            fd = f.fileno()
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            h = hashlib.sha256()
            # No bigger than the file: a reconcile re-hashes millions of small shards.
            buf = bytearray(min(BLOCK, os.fstat(fd).st_size + 1))
            view = memoryview(buf)
            size = 0
            while n := f.readinto(buf):
                h.update(view[:n])
                size += n
                if throttle is not None:
                    throttle.consume(n)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return h.hexdigest(), size

    def quarantine_shard(self, name: str) -> str | None:
        """Move a shard aside (not served, not counted); returns where it went."""
        src = self.path(name)
        dst = os.path.join(self.quarantine, f"{name}.{uuid.uuid4().hex[:8]}")
        try:
            size = os.stat(src).st_size
            os.rename(src, dst)
        except FileNotFoundError:
            return None
        self._counted(-1, -size)
        fsync_dir(os.path.dirname(src))
        fsync_dir(self.quarantine)
        return dst

    def purge_quarantined(self, name: str) -> int:
        """Delete the quarantined copies of ``name`` (once a good copy was verified elsewhere)."""
        self.path(name)  # validates the name
        n = 0
        for entry in os.listdir(self.quarantine):
            if entry.split(".", 1)[0] == name:
                os.unlink(os.path.join(self.quarantine, entry))
                n += 1
        if n:
            fsync_dir(self.quarantine)
        return n

    def quarantined(self) -> list[str]:
        return sorted(os.listdir(self.quarantine))

    def delete(self, name: str) -> bool:
        """Remove a (surplus) shard; True if it was there."""
        path = self.path(name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return False
        self._counted(-1, -size)
        fsync_dir(os.path.dirname(path))
        return True

    def inventory(self) -> Iterator[tuple[str, int]]:
        for dirpath, _dirs, files in os.walk(self.shards):
            for name in files:
                if valid_name(name):
                    yield name, os.stat(os.path.join(dirpath, name)).st_size

    def inventory_page(self, after: str, limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` held shards with a name after ``after``, in name order.

        The layout (``ab/cd/<name>``) sorts the same as the names: the walk skips whole
        directories before ``after`` and stops once the page is full.
        """
        out: list[tuple[str, int]] = []
        for top in sorted(os.listdir(self.shards)):
            if len(top) != 2 or top < after[:2]:
                continue
            top_dir = os.path.join(self.shards, top)
            for mid in sorted(os.listdir(top_dir)):
                if len(mid) != 2 or top + mid < after[:4]:
                    continue
                leaf = os.path.join(top_dir, mid)
                for name in sorted(os.listdir(leaf)):
                    if name > after and valid_name(name):
                        try:
                            out.append((name, os.stat(os.path.join(leaf, name)).st_size))
                        except FileNotFoundError:
                            continue
                        if len(out) >= limit:
                            return out
        return out

    def usage(self) -> tuple[int, int]:
        """``(shards, bytes)`` held."""
        with self._lock:
            return self._count, self._used


class Throttle:
    """Keeps a reader at or under ``rate`` bytes per second (0: unthrottled)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.start = clock()
        self.done = 0

    def consume(self, n: int) -> None:
        if self.rate <= 0:
            return
        self.done += n
        ahead = self.done / self.rate - (self.clock() - self.start)
        if ahead > 0:
            self.sleep(ahead)


def _drain(body: BinaryIO, length: int) -> None:
    remaining = max(length, 0)
    while remaining:
        chunk = body.read(min(BLOCK, remaining))
        if not chunk:
            break
        remaining -= len(chunk)
