"""Fetching shards back: from the first healthy copy, falling back to the next.

Every byte fetched is hashed and compared to the manifest (docs/design.md, invariant 4); a
copy that errors or does not match is skipped for the next one.
"""
from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.cluster.client import WorkerClient
from pipeline.db.models import Checkpoint, CheckpointFile, ContentCopy, Shard, StorageWorker
from pipeline.errors import HashMismatch, RestoreError, WorkerError
from pipeline.hashing import side_thread
from pipeline.states import READABLE_COPIES, WorkerState

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
    #: (worker id, url), best first: verified before stored, live workers before down ones.
    copies: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class FileSource:
    relpath: str
    size: int
    sha256: str
    format: str
    shards: tuple[ShardSource, ...]


def manifest(session: Session, checkpoint: Checkpoint) -> list[FileSource]:
    """Plain-data manifest of ``checkpoint`` with the copies of each shard's content ordered
    by preference."""
    files = list(session.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint.id)
                                 .order_by(CheckpointFile.relpath)))
    shards = {f.id: list(session.scalars(select(Shard).where(Shard.file_id == f.id).order_by(Shard.seq)))
              for f in files}
    shas = {sh.sha256 for rows in shards.values() for sh in rows}
    readable: dict[str, list[tuple[bool, int, int, str, str]]] = {sha: [] for sha in shas}
    for sha, copy_id, state, worker_id, url, worker_state in session.execute(
            select(ContentCopy.sha256, ContentCopy.id, ContentCopy.state, StorageWorker.id, StorageWorker.url,
                   StorageWorker.state).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .where(ContentCopy.sha256.in_(shas), ContentCopy.state.in_(READABLE_COPIES))):
        readable[sha].append((worker_state != WorkerState.UP, _PREFERENCE[state], copy_id, worker_id, url))
    out = []
    for f in files:
        sources = tuple(
            ShardSource(sh.sha256, sh.size, sh.kind, sh.src_offset, sh.length, sh.payload_offset,
                        tuple((worker_id, url) for *_rank, worker_id, url in sorted(readable[sh.sha256])))
            for sh in shards[f.id])
        out.append(FileSource(f.relpath, f.size, f.sha256, f.format, sources))
    return out


def read_ahead(shards: Iterable[ShardSource], key: bytes) -> Iterator[ShardSource]:
    """Yield ``shards`` in order; before each, ask the worker that will serve the next one
    to start reading it from its disk, so that its read overlaps this shard's transfer."""
    items = list(shards)
    for i, shard in enumerate(items):
        if i + 1 < len(items) and items[i + 1].copies:
            worker_id, url = items[i + 1].copies[0]
            try:
                WorkerClient(url, key, worker_id).prefetch([items[i + 1].sha256])
            except WorkerError as exc:  # only a hint: the fetch itself will report the worker
                log.debug("prefetch hint to %s failed: %s", url, exc)
        yield shard


def fetch(shard: ShardSource, key: bytes, sinks: Sequence[Callable[[memoryview], None]],
          reset: Callable[[], None], *, check: bool = True,
          inline: Callable[[memoryview], memoryview] | None = None, into: memoryview | None = None) -> str:
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
    """
    if not shard.copies:
        raise RestoreError(f"shard {shard.sha256[:12]} has no stored copy")
    if into is not None and len(into) != shard.size:
        raise ValueError(f"buffer of {len(into):,} bytes for a shard of {shard.size:,}")
    views = [memoryview(bytearray(BLOCK)) for _ in range(IN_FLIGHT)] if into is None else []
    threads = [side_thread(f"ckpt-sink{i}") for i in range(len(sinks))]
    checker = side_thread("ckpt-check")
    errors = []
    for worker_id, url in shard.copies:
        try:
            conn, resp = WorkerClient(url, key, worker_id, timeout=FETCH_TIMEOUT).open_shard(shard.sha256)
        except WorkerError as exc:
            errors.append(f"{worker_id}: {exc.reason}")
            continue
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
                except OSError as exc:
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
        finally:
            wait([fut for futs in pending for fut in futs])
            conn.close()
        if broke:
            reset()
            continue
        actual = h.hexdigest() if h is not None else None
        if got == shard.size and actual in (None, shard.sha256):
            return worker_id
        if got != shard.size:
            errors.append(f"shard {shard.sha256[:12]} from {worker_id}: {got:,} bytes of {shard.size:,}")
        else:
            errors.append(str(HashMismatch(f"shard {shard.sha256[:12]} from {worker_id}", shard.sha256, actual or "")))
        log.warning("falling back: %s", errors[-1])
        reset()
    raise RestoreError(f"no healthy copy of shard {shard.sha256[:12]}: " + "; ".join(errors))
