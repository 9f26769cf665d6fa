"""The replicate step for a copy on an object store (docs/design.md, "Object-store targets").

A storage worker that holds a verified copy puts it itself, through a PUT presigned here with the
shard's SHA-256 signed in (workers/push.py: it needs no credential, and the store refuses other
bytes), so the trainer's link carries the bytes once; a shard above the multipart threshold, or
no worker able to (one of an earlier release has no push), and the bytes come from the local
file, else from a worker's verified copy streamed to a temporary file of this host and hashed on
the way before anything is put. The store checks each
request's SHA-256 as it receives it; the copy is then confirmed by the store's own checksum
(``HeadObject``): ``pending → stored → verified`` with that checksum recorded on the copy row.
An object the store already holds under the name (another home's, a put whose answer was lost)
is confirmed, not sent again.

A store that throttles, cannot be reached or refuses the credentials leaves the copy ``pending``
with its error: nothing is marked lost, and the store job (or, for a lagging copy, the
scheduler's object-store sweep) sends it again later. A source that is not its name ends the
store (superseded), as for a worker.
"""
from __future__ import annotations

import hashlib
import http.client
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.orm import Session

from pipeline.cluster.client import WorkerClient
from pipeline.db.copies import move
from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy
from pipeline.db.transitions import note, now
from pipeline.errors import MalformedStream, ObjectMismatch, ObjectMissing, ObjectStoreError, WorkerError
from pipeline.objectstore.client import ObjectStore, Stored
from pipeline.objectstore.tier import store_for
from pipeline.settings import Settings
from pipeline.states import CopyState, StoreState
from pipeline.steps import Send
from pipeline.store import replication
from pipeline.store.source import Source, shard_prefix, source_matches

log = logging.getLogger("ckpt.replicate")
BLOCK = 1 << 20
#: The slowest a worker's put on an object store is allowed to be (bytes/s) before its wait ends.
PUSH_RATE = 1 << 20


def send_to_store(settings: Settings, copy_id: int, sha: str, size: int, worker_id: str, src: Source | None,
                  peers: list[tuple[str, str]], named: dict[str, Any] | None) -> list[Send]:
    """Put content ``sha`` on the object store of ``worker_id`` and confirm it; the follow-ups."""
    try:
        stored = put_confirmed(settings, store_for(settings, worker_id), sha, size, src, peers)
        if stored is None:
            return replication._abandon(settings, copy_id, "no local file and no good copy holds its bytes")
    except ObjectMismatch as exc:
        if src is not None and not source_matches(src.path, src.kind, src.tensors, src.offset, src.length, sha):
            return replication._source_gone(settings, copy_id, src, StoreState.SUPERSEDED, str(exc))
        return _wait(settings, copy_id, str(exc))  # sent again: the store refused damaged bytes
    except ObjectStoreError as exc:
        return _wait(settings, copy_id, str(exc))
    except OSError as exc:
        assert src is not None
        end = StoreState.VANISHED if isinstance(exc, FileNotFoundError) else StoreState.SUPERSEDED
        return replication._source_gone(settings, copy_id, src, end, f"{src.path}: {exc}")
    with session_scope(settings.db_url) as s:
        record_confirmed(s, ContentCopy.id == copy_id, stored, from_=(CopyState.PENDING,))
        return replication.fan_in(s, settings, sha)


def put_confirmed(settings: Settings, store: ObjectStore, sha: str, size: int, src: Source | None,
                  peers: list[tuple[str, str]]) -> Stored | None:
    """Put content ``sha`` on ``store``, unless the store already proves it holds it: by a worker
    of ``peers`` ((url, worker id) of verified copies) itself (:func:`_pushed`), else from the
    local file ``src``, else from the first of ``peers`` whose bytes hash to it; then confirm it
    by the store's checksum. None when no source holds its bytes. Raises ObjectStoreError
    (ObjectMismatch: the store refused the bytes, or holds others)."""
    stored = _held(store, sha, size)
    if stored is None and size <= store.target.multipart_threshold:
        stored = _pushed(settings, store, sha, size, peers)
    if stored is not None:
        return stored
    if src is not None:
        put = store.put(sha, Path(src.path), offset=src.offset, length=src.length,
                        head=shard_prefix(src.path, src.kind, src.tensors))
    else:
        fetched = _put_from_peer(settings, store, sha, size, peers)
        if fetched is None:
            return None
        put = fetched
    return store.confirm(sha, size, put.checksum)


def record_confirmed(s: Session, where: ColumnElement[bool], stored: Stored, *, from_: Iterable[str]) -> bool:
    """Record a copy on an object store that the store's checksum confirmed: ``from_ → stored →
    verified`` (the checksum stands for a worker's re-hash) with that checksum; whether it moved."""
    t = now()
    if not move(s, where, CopyState.STORED, at=t, from_=from_):
        return False
    s.execute(update(ContentCopy).where(where).values(checksum=stored.checksum))
    move(s, where, CopyState.VERIFIED, at=t, from_=(CopyState.STORED,))
    return True


def _pushed(settings: Settings, store: ObjectStore, sha: str, size: int,
            peers: list[tuple[str, str]]) -> Stored | None:
    """The object put by a worker from its verified copy (workers/push.py: a presigned PUT, the
    SHA-256 signed into it) and confirmed here; None when no worker could (one of an earlier
    release has no push: the bytes go from here)."""
    key = settings.key()
    for url, peer_id in peers:
        presigned, headers = store.presign_put(sha)
        try:
            answer = WorkerClient(url, key, peer_id, timeout=max(settings.stall_seconds, size / PUSH_RATE)).push(
                sha, size, presigned, headers)
        except WorkerError as exc:
            log.info("worker %s did not put %s on %s (%s); trying another way", peer_id, sha[:12],
                     store.target.name, exc)
            continue
        if answer.get("status") not in (200, 201):
            log.warning("worker %s's put of %s on %s: %s %s", peer_id, sha[:12], store.target.name,
                        answer.get("status"), str(answer.get("error"))[:200])
            continue
        try:
            return store.confirm(sha, size)
        except (ObjectMissing, ObjectMismatch) as exc:
            log.warning("worker %s's put of %s: not confirmed (%s)", peer_id, sha[:12], exc)
    return None


def _held(store: ObjectStore, sha: str, size: int) -> Stored | None:
    """The object already on the store under ``sha``, if the store's checksum proves it (one PUT's)."""
    try:
        return store.confirm(sha, size)
    except (ObjectMissing, ObjectMismatch):
        return None  # absent, or not provable without the put's composite: put (again)


def _put_from_peer(settings: Settings, store: ObjectStore, sha: str, size: int,
                   peers: list[tuple[str, str]]) -> Stored | None:
    """Put the content from a worker's verified copy, through a temporary file hashed on the way."""
    key = settings.key()
    for url, peer_id in peers:
        fd, name = spool_file(settings, f"bucket-{sha[:12]}-")
        try:
            with os.fdopen(fd, "wb") as out:
                if not _fetch(WorkerClient(url, key, peer_id, timeout=settings.stall_seconds), sha, size, out):
                    continue
            return store.put(sha, Path(name))
        except WorkerError as exc:
            log.warning("copy of %s from %s for the object store failed: %s", sha[:12], peer_id, exc)
        finally:
            os.unlink(name)
    return None


def spool_file(settings: Settings, prefix: str) -> tuple[int, str]:
    """A new temporary file under the home (``<home>/tmp``) for a shard on its way between a worker
    and an object store: its descriptor and path. The caller removes it."""
    spool = Path(settings.home) / "tmp"
    spool.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(prefix=prefix, dir=spool)


def _fetch(client: WorkerClient, sha: str, size: int, out: Any) -> bool:
    """Stream ``sha`` from a worker into ``out``; whether its bytes hash to ``sha``."""
    conn, resp = client.open_shard(sha, size=size)
    try:
        h, got = hashlib.sha256(), 0
        buf = memoryview(bytearray(BLOCK))
        while got < size:
            n = resp.readinto(buf)
            if not n:
                break
            h.update(buf[:n])
            out.write(buf[:n])
            got += n
    except (OSError, http.client.HTTPException, MalformedStream) as exc:
        raise WorkerError(client.url, f"GET of {sha[:12]} cut short ({exc})") from None
    finally:
        conn.close()
    if got != size or h.hexdigest() != sha:
        log.warning("copy of %s on %s does not hash to its name; trying another", sha[:12], client.url)
        return False
    return True


def _wait(settings: Settings, copy_id: int, why: str) -> list[Send]:
    """The store cannot take the copy now: it stays pending with the reason, which the stores
    waiting for it show; sent again later."""
    with session_scope(settings.db_url) as s:
        s.execute(update(ContentCopy).where(ContentCopy.id == copy_id, ContentCopy.state == CopyState.PENDING)
                  .values(last_error=why[:1000]))
        sha = s.scalar(select(ContentCopy.sha256).where(ContentCopy.id == copy_id))
        reason = f"waiting for its object-store copy: {why[:300]}"
        for job in replication.waiting_jobs(s, sha or ""):
            if job.blocked_reason != reason:
                job.blocked_reason = reason
                note(s, job.id, reason)
    log.warning("copy %d waits for its object store: %s", copy_id, why)
    return []
