"""An object store as a row of ``storage_workers``: its id, its connection, its probe.

Each ``[[targets]]`` bucket is recorded as a storage row of tier ``objectstore`` (id
``target:<name>``, url ``s3://bucket/prefix``, source ``target``), so a copy on it is a row of
``copies`` moved by the one mover (pipeline.db.copies.move) under the one good-copy rule, and
counted by the tier policy (``target_copies``, ``target_mode``: pipeline.core.copies.Need), never
toward the workers' RF (docs/design.md, "Object-store targets").

:func:`probe` is the scheduler's: it records each configured target (a new one ``candidate``,
like a worker found on mDNS) and asks its bucket, all at once, each within ``probe_seconds`` (a
partitioned endpoint answers nothing and holds nothing up). A bucket that answers is ``up``, or
``full`` at its quota's high watermark (capacity is the configured ``quota_bytes``; what it holds
is the sum of the copies recorded on it, read from the database, not listed); one that does not
keeps its copies counting until it answered nothing for ``worker_down_seconds``, then is ``down``
(its error says why: credentials, a missing bucket, throttling). A target no longer configured
is ``down`` with that reason: its copies stop counting, and the row stays for its history.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from datetime import timedelta

from sqlalchemy import select

from pipeline.cluster.client import WorkerClient
from pipeline.db import workers
from pipeline.db.copies import held_per_worker
from pipeline.db.engine import session_scope
from pipeline.db.identity import control_plane_id
from pipeline.db.models import StorageWorker
from pipeline.db.transitions import now
from pipeline.errors import ObjectMissing, ObjectStoreError
from pipeline.objectstore import keys
from pipeline.objectstore.client import ObjectStore
from pipeline.objectstore.config import PREFIX, Target, row_id
from pipeline.settings import Settings
from pipeline.states import COUNTING_WORKERS, Tier, WorkerState

log = logging.getLogger("ckpt.objectstore")

#: A bucket without a quota is weighted as this much free space by placement.
UNLIMITED = 1 << 50

_stores: dict[str, ObjectStore] = {}
_lock = threading.Lock()


def is_target(worker_id: str) -> bool:
    return worker_id.startswith(PREFIX)


def store_for(settings: Settings, worker_id: str) -> ObjectStore:
    """The connection to the target of storage row ``worker_id`` (one per process and target
    configuration). Raises ObjectStoreError (a wait) for a target no longer configured."""
    name = worker_id.removeprefix(PREFIX)
    target = next((t for t in settings.object_targets() if t.name == name), None)
    if target is None:
        raise ObjectStoreError(name, "no longer configured ([[targets]]): its copies are kept but not used; "
                                     "configure it again, or `ckpt workers remove` it once nothing needs it")
    with _lock:
        store = _stores.get(worker_id)
        if store is None or store.target != target:
            store = _stores[worker_id] = ObjectStore(target)
        return store


class TargetClient:
    """The part of a storage worker's client (pipeline.cluster.client.WorkerClient) that
    rotation, garbage collection and reconciliation use, on an object store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.url = store.target.url

    def head(self, name: str) -> int | None:
        """The size of the object that holds ``name``'s bytes, None if there is none: an object
        with no SHA-256, or a one-PUT SHA-256 that is not its name, is other bytes under the key
        (overwritten since its confirm) and holds nothing. A multipart object's composite is
        checked by the scrub against the one recorded with its copy."""
        try:
            got = self.store.head(name)
        except ObjectMissing:
            return None
        if not got.checksum or (not keys.is_composite(got.checksum) and got.checksum != keys.full_checksum(name)):
            return None
        return got.size

    def stat(self, names: list[str]) -> dict[str, int | None]:
        return {n: self.head(n) for n in names}

    def delete(self, name: str) -> bool:
        self.store.delete(name)
        return True

    def delete_many(self, names: list[str]) -> dict[str, bool]:
        return {n: self.delete(n) for n in names}


def client_for(settings: Settings, worker_id: str, url: str, *,
               timeout: float | None = None) -> WorkerClient | TargetClient:
    """The client of storage row ``worker_id``: a storage worker's HTTP client, or an object store's."""
    if is_target(worker_id):
        return TargetClient(store_for(settings, worker_id))
    if timeout is None:
        return WorkerClient(url, settings.key(), worker_id)
    return WorkerClient(url, settings.key(), worker_id, timeout=timeout)


#: The object that names the control plane owning a target's prefix.
OWNER = ".ckpt-home"


class ForeignPrefix(ObjectStoreError):
    """The prefix belongs to another control plane (its ``.ckpt-home`` names another id)."""


def owner_key(target: Target) -> str:
    return f"{target.prefix}/{OWNER}" if target.prefix else OWNER


def claim_prefix(store: ObjectStore, owner: str) -> None:
    """Make sure the target's prefix is this control plane's: its ``.ckpt-home`` object names
    ``owner`` (written if absent, read back: of two control planes writing at once, the one whose
    id stays wins). Raises ForeignPrefix when it names another."""
    t, key = store.target, owner_key(store.target)
    if time.monotonic() - _claimed.get((t.endpoint, t.url, owner), -CLAIM_SECONDS) < CLAIM_SECONDS:
        return  # confirmed ours by this process lately: read again now and then, not every tick

    def read() -> str | None:
        try:
            r = store.call(f"read of {key}", store.s3.get_object, Bucket=t.bucket, Key=key)
        except ObjectMissing:
            return None
        return bytes(r["Body"].read(256)).decode("utf-8", "replace").strip()

    found = read()
    if found is None:
        store.call(f"put of {key}", store.s3.put_object, Bucket=t.bucket, Key=key, Body=owner.encode(),
                   ContentType="text/plain")
        found = read()
    if found != owner:
        raise ForeignPrefix(t.name, f"{t.url} belongs to another ckpt home (control plane {str(found)[:8]}..., "
                                    f"named in {key}): its collection would delete this home's objects and this "
                                    f"one its; give each home a prefix of its own (e.g. {t.url}/<home>), or remove "
                                    f"{key} if that home is gone for good")
    _claimed[t.endpoint, t.url, owner] = time.monotonic()


#: Prefixes this process confirmed as its control plane's, and when (monotonic): the marker is read
#: again after CLAIM_SECONDS, not at every probe.
_claimed: dict[tuple[str, str, str], float] = {}
CLAIM_SECONDS = 600.0


def _ask(settings: Settings, target: Target, owner: str) -> str | None:
    """None if the target's bucket answers and its prefix is this control plane's, else why not
    (never raises)."""
    try:
        store = store_for(settings, row_id(target.name))
        store.call(f"head of bucket {target.bucket}", store.s3.head_bucket, Bucket=target.bucket)
        claim_prefix(store, owner)
        return None
    except ForeignPrefix as exc:
        return FOREIGN + str(exc)
    except ObjectStoreError as exc:
        return str(exc)
    except Exception as exc:  # an answer nobody foresaw is still only this target's problem
        log.exception("probing object store %s failed unexpectedly", target.name)
        return f"object store {target.name}: probe failed ({type(exc).__name__}: {exc})"


#: What a probe's answer starts with when the prefix is another control plane's.
FOREIGN = "not this home's: "


def probe(settings: Settings) -> list[str]:
    """Record every configured target and what its bucket answered now; the ids of those that
    came back (from down: their copies count again)."""
    configured = {row_id(t.name): t for t in settings.object_targets()}
    with session_scope(settings.db_url) as s:
        owner = control_plane_id(s)
    futures: dict[str, Future[str | None]] = {}
    for wid, target in configured.items():
        future: Future[str | None] = Future()
        futures[wid] = future
        threading.Thread(target=lambda t=target, f=future: f.set_result(_ask(settings, t, owner)),
                         name=f"probe {wid}", daemon=True).start()
    done, _late = wait(futures.values(), timeout=settings.probe_seconds + 1.0) if futures else (set(), set())
    answers = {wid: f.result() if f in done else f"object store {wid}: no answer within {settings.probe_seconds:g} s"
               for wid, f in futures.items()}
    with session_scope(settings.db_url) as s:
        held = held_per_worker(s, configured)
    used = {wid: held.get(wid, (0, 0))[1] for wid in configured}
    returned: list[str] = []
    t = now()
    with session_scope(settings.db_url) as s:
        rows = {w.id: w for w in s.scalars(select(StorageWorker).where(StorageWorker.tier == Tier.OBJECT_STORE))}
        for wid, target in configured.items():
            w = rows.get(wid) or workers.add(s, wid, target.url, source="target", zone=f"objectstore:{target.name}")
            w.tier, w.url = Tier.OBJECT_STORE.value, target.url
            error = answers[wid]
            if error is None:
                quota = target.quota_bytes or 0
                w.capacity_bytes, w.used_bytes = quota, used[wid]
                w.free_bytes = max(0, quota - used[wid]) if quota else UNLIMITED
                full = quota > 0 and used[wid] >= settings.high_watermark * quota
                live = WorkerState.FULL if full else WorkerState.UP
                if workers.may(w, live):
                    if w.state in (WorkerState.DOWN, WorkerState.REJECTED):
                        returned.append(wid)
                    if w.state not in COUNTING_WORKERS:
                        log.info("object store %s (%s) answers: its copies count", wid, target.url)
                    workers.set_state(s, w, live)
                w.last_seen, w.last_error = t, None
                continue
            w.last_error = error
            silent = w.last_seen is None or t - w.last_seen > timedelta(seconds=settings.worker_down_seconds)
            if error.startswith(FOREIGN) and w.state in (WorkerState.CANDIDATE, *COUNTING_WORKERS):
                workers.observe(s, w, WorkerState.DOWN, error=error)  # at once: its objects are not ours
                log.error("object store %s: %s", wid, error)
            elif w.state in COUNTING_WORKERS and silent:
                workers.set_state(s, w, WorkerState.DOWN)
                log.warning("object store %s is down: %s", wid, error)
        for wid, w in rows.items():
            if wid not in configured and w.state in COUNTING_WORKERS:
                workers.observe(s, w, WorkerState.DOWN, error="no longer configured ([[targets]])")
    return returned


__all__ = ["PREFIX", "TargetClient", "client_for", "is_target", "probe", "row_id", "store_for"]
