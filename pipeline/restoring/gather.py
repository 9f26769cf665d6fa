"""Fetching shards back: from the first healthy copy, falling back to the next.

Every byte fetched is hashed and compared to the manifest (docs/design.md, invariant 4); a
copy that errors or does not match is skipped for the next one. Copies on storage workers
come first (the local network); a copy on an object store (url ``s3://``, a ``[[targets]]``
bucket) is the source of last resort, read only when every worker copy failed or none exists
(all workers lost), with parallel ranged GETs (pipeline.objectstore.download.Stream) through
the same sinks and hash check. A store that cannot serve it now ends the fetch with
:class:`StoreUnavailable`, which names the store and what to do.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from pipeline import settings as settings_mod
from pipeline.cluster.client import WorkerClient
from pipeline.cluster.decoding import Decompressing
from pipeline.cluster.wire import METER
from pipeline.db.models import Checkpoint, CheckpointFile, ContentCopy, Shard, StorageWorker
from pipeline.errors import HashMismatch, MalformedStream, ObjectStoreError, RestoreError, StoreUnavailable, WorkerError
from pipeline.hashing import side_thread
from pipeline.restoring.links import LINKS
from pipeline.states import READABLE_COPIES, READABLE_WORKERS, Tier, WorkerState

if TYPE_CHECKING:
    from pipeline.settings import Settings

log = logging.getLogger("ckpt.gather")
BLOCK = 4 * 1024 * 1024
#: Blocks received ahead of the slowest sink (absorbs a sink's stalls on the disk).
IN_FLIGHT = 4
#: A worker sends a shard without pause: this long without a byte, the copy is given up
#: for the next one (a peer that vanished without a reset would hang a restore).
FETCH_TIMEOUT = 30.0
#: Copies a restore reads, best first.
_PREFERENCE = {state: rank for rank, state in enumerate(READABLE_COPIES)}
#: Kinds of copy by where they are, best first (a copy's rank: ``place * len(_PREFERENCE) +
#: its state's preference``): a live storage worker, a worker not seen lately, an object store.
LIVE, UNSEEN, STORE = range(3)


def on_store(url: str) -> bool:
    """Whether a copy at ``url`` is on an object store (``s3://bucket/prefix``), not a worker."""
    return urlsplit(url).scheme == "s3"


@dataclass(frozen=True)
class ShardSource:
    sha256: str
    size: int
    kind: str
    src_offset: int
    length: int
    payload_offset: int
    #: (worker id, url), best first: live workers before down ones before object stores (url
    #: ``s3://``), verified before stored, then spread over the workers by bytes (:func:`manifest`).
    copies: tuple[tuple[str, str], ...]
    #: Per copy, how good a kind of copy it is (0 best): among copies of one rank, a fetch
    #: reads the one whose worker's link is least busy (pipeline/restoring/links.py).
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class FileSource:
    relpath: str
    size: int
    sha256: str
    format: str
    shards: tuple[ShardSource, ...]


def manifest(session: Session, checkpoint: Checkpoint) -> list[FileSource]:
    """Plain-data manifest of ``checkpoint`` with the copies of each shard's content ordered
    by preference: live workers first, then workers not seen lately, then object stores that
    answer (the source of last resort); verified copies before stored ones, then the worker
    this restore reads least from (so consecutive shards come from different workers, and
    each worker's disk reads the next while another sends)."""
    files = list(session.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint.id)
                                 .order_by(CheckpointFile.relpath)))
    shards = {f.id: list(session.scalars(select(Shard).where(Shard.file_id == f.id).order_by(Shard.seq)))
              for f in files}
    shas = {sh.sha256 for rows in shards.values() for sh in rows}
    readable: dict[str, list[tuple[int, int, int, str, str]]] = {sha: [] for sha in shas}
    for sha, copy_id, state, worker_id, url, worker_state, tier in session.execute(
            select(ContentCopy.sha256, ContentCopy.id, ContentCopy.state, StorageWorker.id, StorageWorker.url,
                   StorageWorker.state, StorageWorker.tier)
            .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .where(ContentCopy.sha256.in_(shas), ContentCopy.state.in_(READABLE_COPIES),
                   # An object store is read only while it answers its probe (up, full, draining).
                   or_(StorageWorker.tier != Tier.OBJECT_STORE, StorageWorker.state.in_(sorted(READABLE_WORKERS))))):
        place = STORE if tier == Tier.OBJECT_STORE else LIVE if worker_state == WorkerState.UP else UNSEEN
        readable[sha].append((place, _PREFERENCE[state], copy_id, worker_id, url))
    out = []
    load: dict[str, int] = {}  # bytes this restore reads from each worker so far
    for f in files:
        sources = []
        for sh in shards[f.id]:
            # Among equally good copies, the worker with the least to send first: a restore
            # reads from every worker holding its shards rather than from the first one placed.
            ranked = sorted(readable[sh.sha256], key=lambda r: (r[0], r[1], load.get(r[3], 0), r[2]))
            if ranked:
                load[ranked[0][3]] = load.get(ranked[0][3], 0) + sh.size
            sources.append(ShardSource(sh.sha256, sh.size, sh.kind, sh.src_offset, sh.length, sh.payload_offset,
                                       tuple((worker_id, url) for *_rank, worker_id, url in ranked),
                                       tuple(place * len(_PREFERENCE) + pref for place, pref, *_ in ranked)))
        out.append(FileSource(f.relpath, f.size, f.sha256, f.format, tuple(sources)))
    return out


def fetch(shard: ShardSource, key: bytes, sinks: Sequence[Callable[[memoryview], None]],
          reset: Callable[[], None], *, check: bool = True,
          inline: Callable[[memoryview], memoryview] | None = None, into: memoryview | None = None,
          wire: str = "off", settings: Settings | None = None) -> str:
    """Stream ``shard`` into ``sinks`` from the first copy whose bytes match the manifest.

    Every sink receives every byte of the shard in order, each in a helper thread of its
    own (a write in one, the caller's hash in another; the shard's own SHA-256 in a third),
    while this thread receives the next blocks: socket reads, hashlib and ``os.pwrite``
    release the GIL, so they run on all cores. ``inline``, if given, runs on each block in
    this thread, in order, and returns what is passed on to the sinks. ``reset`` is called
    before a fallback so the caller can discard what a bad copy gave. ``into``, a buffer
    of the shard's size, receives the shard itself (not copied). Returns the worker id used.

    ``check=False`` skips the shard's own SHA-256: for a caller that verifies every byte it
    keeps against a hash of its own (a restored file's), and comes back with ``check=True``
    to find the bad copy when that hash does not match. A copy that sends a wrong
    number of bytes is skipped either way.

    Of equally good copies, the one read is the one whose worker this process reads least
    from at the moment (pipeline/restoring/links.py): shards fetched at once come from
    different workers. ``wire="auto"``: a copy is asked compressed when that is faster
    (pipeline/cluster/wire.py).

    A copy on an object store is read last, through ``settings``' target of its row (default:
    this process's settings). Raises :class:`StoreUnavailable` when every copy failed and an
    object store's failure was one that waits (throttling, unreachable, credentials, bucket).
    """
    if not shard.copies:
        raise RestoreError(f"shard {shard.sha256[:12]} has no stored copy")
    if into is not None and len(into) != shard.size:
        raise ValueError(f"buffer of {len(into):,} bytes for a shard of {shard.size:,}")
    views = [memoryview(bytearray(BLOCK)) for _ in range(IN_FLIGHT)] if into is None else []
    threads = [side_thread(f"ckpt-sink{i}") for i in range(len(sinks))]
    checker = side_thread("ckpt-check")
    failed = _Failures()
    with LINKS.reading(shard.copies, shard.ranks) as turns:
        for worker_id, url in turns:
            if _fetch_from(shard, key, worker_id, url, sinks, threads, checker, views, reset, failed,
                           check=check, inline=inline, into=into, wire=wire, settings=settings):
                return worker_id
    if failed.store_down:
        url, cause = failed.store_down[-1]
        raise StoreUnavailable(f"shard {shard.sha256[:12]}", url, cause, failed.workers)
    raise RestoreError(f"no healthy copy of shard {shard.sha256[:12]}: " + "; ".join(failed.errors))


@dataclass
class _Failures:
    """Why each copy a fetch tried failed: every copy's reason (``errors``), the worker copies'
    alone (``workers``), and the object stores that could not serve at all (``store_down``)."""

    errors: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    store_down: list[tuple[str, ObjectStoreError]] = field(default_factory=list)

    def add(self, url: str, error: str, cause: ObjectStoreError | None = None) -> None:
        self.errors.append(error)
        if not on_store(url):
            self.workers.append(error)
        elif cause is not None and cause.wait:
            self.store_down.append((url, cause))


def _open(shard: ShardSource, key: bytes, worker_id: str, url: str, wire: str,
          settings: Settings | None) -> tuple[Any, Any]:
    """(connection to close, answer to read the shard from) of one copy: a storage worker's
    HTTP answer, or an object store's ranged GETs (its ObjectStoreError raised as it comes)."""
    if not on_store(url):
        codecs = (settings or settings_mod.current()).wire_codecs
        return WorkerClient(url, key, worker_id, timeout=FETCH_TIMEOUT).open_shard(shard.sha256, size=shard.size,
                                                                                   wire=wire, codecs=codecs)
    from pipeline.objectstore.tier import store_for  # boto3: only when a store is read

    stream = store_for(settings or settings_mod.current(), worker_id).open(shard.sha256, shard.size)
    return stream, stream


def _fetch_from(shard: ShardSource, key: bytes, worker_id: str, url: str,
                sinks: Sequence[Callable[[memoryview], None]], threads: list[Any], checker: Any,
                views: list[memoryview], reset: Callable[[], None], failed: _Failures, *, check: bool,
                inline: Callable[[memoryview], memoryview] | None, into: memoryview | None, wire: str,
                settings: Settings | None) -> bool:
    """One copy of :func:`fetch`: True once its bytes reached every sink and matched; else
    why it did not is in ``failed`` and ``reset`` has been called."""
    started = time.monotonic()
    where = f"object store {url}" if on_store(url) else worker_id
    try:
        conn, resp = _open(shard, key, worker_id, url, wire, settings)
    except WorkerError as exc:
        failed.add(url, f"{worker_id}: {exc.reason}")
        return False
    except ObjectStoreError as exc:
        failed.add(url, f"{where}: {exc}", exc)
        return False
    h = hashlib.sha256() if check else None
    got, blocks, broke = 0, 0, False
    pending: deque[list[Future]] = deque()  # per block in flight, its sinks' futures
    try:
        while True:
            if len(pending) == IN_FLIGHT:  # the block that used this buffer must be done
                for fut in pending.popleft():
                    fut.result()  # in order; the sinks' own errors are raised here
            view = views[blocks % IN_FLIGHT] if into is None else into[got:got + BLOCK]
            try:
                n = resp.readinto(view) if view else len(resp.read(1))
            except (OSError, MalformedStream) as exc:
                failed.add(url, f"{where}: transfer broke after {got:,} bytes ({exc})")
                broke = True
                break
            except ObjectStoreError as exc:
                failed.add(url, f"{where}: after {got:,} bytes: {exc}", exc)
                broke = True
                break
            if not n:
                break
            if got + n > shard.size:
                failed.add(url, f"shard {shard.sha256[:12]} from {where}: more than its {shard.size:,} bytes")
                broke = True
                break
            chunk = view[:n]
            futures = [checker.submit(h.update, chunk)] if h is not None else []
            if inline is not None:
                chunk = inline(chunk)
            if chunk:
                futures += [t.submit(sink, chunk) for t, sink in zip(threads, sinks, strict=True)]
            pending.append(futures)
            got, blocks = got + n, blocks + 1
        while pending:
            for fut in pending.popleft():
                fut.result()
        if not broke and isinstance(resp, Decompressing):
            try:
                resp.finish()
            except (OSError, MalformedStream) as exc:
                failed.add(url, f"{worker_id}: compressed stream after {got:,} bytes: {exc}")
                broke = True
    finally:
        wait([fut for futs in pending for fut in futs])
        conn.close()
    if not broke and got == shard.size and not on_store(url):  # the meter is of workers' links
        METER.transfer(url, "down", got, resp.wire if isinstance(resp, Decompressing) else got,
                       time.monotonic() - started)
    if not broke:
        actual = h.hexdigest() if h is not None else None
        if got == shard.size and actual in (None, shard.sha256):
            return True
        if got != shard.size:
            failed.add(url, f"shard {shard.sha256[:12]} from {where}: {got:,} bytes of {shard.size:,}")
        else:
            failed.add(url, str(HashMismatch(f"shard {shard.sha256[:12]} from {where}", shard.sha256, actual or "")))
        log.warning("falling back: %s", failed.errors[-1])
    reset()
    return False


class Tally:
    """Where a restore read each of its shards (thread-safe): the tier it says it read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read: dict[tuple[str, int], str] = {}  # (file, offset) -> url read from

    def record(self, relpath: str, shard: ShardSource, worker_id: str) -> None:
        """``shard`` of ``relpath`` was read from ``worker_id`` (a second read of it, after a
        file's hash mismatch, replaces the first)."""
        url = dict(shard.copies).get(worker_id, "")
        with self._lock:
            self._read[(relpath, shard.src_offset)] = url

    def summary(self) -> str:
        """Which tiers were read, as "read 12 shards from workers, 3 from object store s3://bucket/prefix"."""
        with self._lock:
            urls = list(self._read.values())
        stores = Counter(u for u in urls if on_store(u))
        parts = [(n, where) for n, where in [(len(urls) - sum(stores.values()), "workers")] if n]
        parts += [(n, f"object store {u}") for u, n in sorted(stores.items())]
        if not parts:
            return "read no shards"
        (n, where), rest = parts[0], parts[1:]
        return f"read {n} shard{'s' if n != 1 else ''} from {where}" + "".join(f", {m} from {w}" for m, w in rest)
