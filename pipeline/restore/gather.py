"""Fetching shards back: from the first healthy copy, falling back to the next.

Every byte fetched is hashed and compared to the manifest (docs/design.md, invariant 4); a
copy that errors or does not match is skipped for the next one.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.cluster.client import WorkerClient
from pipeline.cluster.decoding import Decompressing
from pipeline.cluster.wire import METER
from pipeline.db.models import Checkpoint, CheckpointFile, ContentCopy, Shard, StorageWorker
from pipeline.errors import HashMismatch, MalformedStream, RestoreError, WorkerError
from pipeline.hashing import side_thread
from pipeline.restore.links import LINKS
from pipeline.states import READABLE_COPIES, Tier, WorkerState

log = logging.getLogger("ckpt.gather")
BLOCK = 4 * 1024 * 1024
#: Blocks received ahead of the slowest sink (absorbs a sink's stalls on the disk).
IN_FLIGHT = 4
#: A worker sends a shard without pause: this long without a byte, the copy is given up
#: for the next one (a peer that vanished without a reset would hang a restore).
FETCH_TIMEOUT = 30.0
#: Copies a restore reads, best first.
_PREFERENCE = {state: rank for rank, state in enumerate(READABLE_COPIES)}


@dataclass(frozen=True)
class ShardSource:
    sha256: str
    size: int
    kind: str
    src_offset: int
    length: int
    payload_offset: int
    #: (worker id, url), best first: live workers before down ones, verified before stored,
    #: then spread over the workers by bytes (:func:`manifest`).
    copies: tuple[tuple[str, str], ...]
    #: Per copy, how good a kind of copy it is (0 best): among copies of one rank, a fetch
    #: reads the one whose worker's link is least busy (pipeline/restore/links.py).
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
    by preference: live workers first, verified copies before stored ones, then the worker
    this restore reads least from (so consecutive shards come from different workers, and
    each worker's disk reads the next while another sends)."""
    files = list(session.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint.id)
                                 .order_by(CheckpointFile.relpath)))
    shards = {f.id: list(session.scalars(select(Shard).where(Shard.file_id == f.id).order_by(Shard.seq)))
              for f in files}
    shas = {sh.sha256 for rows in shards.values() for sh in rows}
    readable: dict[str, list[tuple[bool, int, int, str, str]]] = {sha: [] for sha in shas}
    for sha, copy_id, state, worker_id, url, worker_state in session.execute(
            select(ContentCopy.sha256, ContentCopy.id, ContentCopy.state, StorageWorker.id, StorageWorker.url,
                   StorageWorker.state).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            # The workers' tier: a worker's client cannot read a bucket (restore from a target is next).
            .where(ContentCopy.sha256.in_(shas), ContentCopy.state.in_(READABLE_COPIES),
                   StorageWorker.tier == Tier.WORKERS)):
        readable[sha].append((worker_state != WorkerState.UP, _PREFERENCE[state], copy_id, worker_id, url))
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
                                       tuple(down * len(_PREFERENCE) + pref for down, pref, *_ in ranked)))
        out.append(FileSource(f.relpath, f.size, f.sha256, f.format, tuple(sources)))
    return out


def fetch(shard: ShardSource, key: bytes, sinks: Sequence[Callable[[memoryview], None]],
          reset: Callable[[], None], *, check: bool = True,
          inline: Callable[[memoryview], memoryview] | None = None, into: memoryview | None = None,
          wire: str = "off") -> str:
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
    from at the moment (pipeline/restore/links.py): shards fetched at once come from
    different workers. ``wire="auto"``: a copy is asked compressed when that is faster
    (pipeline/cluster/wire.py).
    """
    if not shard.copies:
        raise RestoreError(f"shard {shard.sha256[:12]} has no stored copy")
    if into is not None and len(into) != shard.size:
        raise ValueError(f"buffer of {len(into):,} bytes for a shard of {shard.size:,}")
    views = [memoryview(bytearray(BLOCK)) for _ in range(IN_FLIGHT)] if into is None else []
    threads = [side_thread(f"ckpt-sink{i}") for i in range(len(sinks))]
    checker = side_thread("ckpt-check")
    errors: list[str] = []
    with LINKS.reading(shard.copies, shard.ranks) as turns:
        for worker_id, url in turns:
            if _fetch_from(shard, key, worker_id, url, sinks, threads, checker, views, reset, errors,
                           check=check, inline=inline, into=into, wire=wire):
                return worker_id
    raise RestoreError(f"no healthy copy of shard {shard.sha256[:12]}: " + "; ".join(errors))


def _fetch_from(shard: ShardSource, key: bytes, worker_id: str, url: str,
                sinks: Sequence[Callable[[memoryview], None]], threads: list[Any], checker: Any,
                views: list[memoryview], reset: Callable[[], None], errors: list[str], *, check: bool,
                inline: Callable[[memoryview], memoryview] | None, into: memoryview | None, wire: str) -> bool:
    """One copy of :func:`fetch`: True once its bytes reached every sink and matched; else
    why it did not is in ``errors`` and ``reset`` has been called."""
    started = time.monotonic()
    try:
        conn, resp = WorkerClient(url, key, worker_id, timeout=FETCH_TIMEOUT).open_shard(
            shard.sha256, size=shard.size, wire=wire)
    except WorkerError as exc:
        errors.append(f"{worker_id}: {exc.reason}")
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
                errors.append(f"{worker_id}: transfer broke after {got:,} bytes ({exc})")
                broke = True
                break
            if not n:
                break
            if got + n > shard.size:
                errors.append(f"shard {shard.sha256[:12]} from {worker_id}: more than its {shard.size:,} bytes")
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
                errors.append(f"{worker_id}: compressed stream after {got:,} bytes: {exc}")
                broke = True
    finally:
        wait([fut for futs in pending for fut in futs])
        conn.close()
    if not broke and got == shard.size:
        METER.transfer(url, "down", got, resp.wire if isinstance(resp, Decompressing) else got,
                       time.monotonic() - started)
    if not broke:
        actual = h.hexdigest() if h is not None else None
        if got == shard.size and actual in (None, shard.sha256):
            return True
        if got != shard.size:
            errors.append(f"shard {shard.sha256[:12]} from {worker_id}: {got:,} bytes of {shard.size:,}")
        else:
            errors.append(str(HashMismatch(f"shard {shard.sha256[:12]} from {worker_id}", shard.sha256, actual or "")))
        log.warning("falling back: %s", errors[-1])
    reset()
    return False
