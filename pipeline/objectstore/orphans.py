"""Orphans on an object store: objects under a target's prefix that no copy row names.

A put whose answer was lost (the copy was given up and placed elsewhere), a home restored from
an older database, a ``ckpt target add`` probe in flight: the bucket holds an object the
control plane does not count. The target's collection (pipeline.integrity.gc.collect), once
its condemned copies are gone, pages through the bucket's inventory from a cursor saved after
every page and deletes an object only when

- the store says it was written more than ``gc_orphan_grace_seconds`` ago (a put in flight, or
  one whose row a transaction is about to commit, is always younger; a multipart object's
  ``LastModified`` is when its upload began, which only makes it look older while a row names
  it), and
- no copy row on the target, nor on another storage row at the same ``s3://bucket/prefix`` (a
  target renamed in config.toml: its old row keeps its copies), names it in a state that holds
  or awaits a file (``pending``, ``stored``, ``verified``, ``corrupt``, ``missing``).

A content the control plane knows is claimed first, under its row lock, as a ``deleting`` copy
(a new one, or one given up, ``abandoned``/``trimmed``, moved by compare-and-set): placement
never reuses a ``deleting`` row, so no upload and no "already there" confirmation lands on an
object about to go; the row is forgotten once the object is. An object whose content has no row
at all can be named by nothing until a store references that content again.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from itertools import islice
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.copies import move, new_copy
from pipeline.db.engine import session_scope
from pipeline.db.models import Content, ContentCopy, StorageWorker
from pipeline.db.transitions import now, renew_lease
from pipeline.integrity.gc import copy_deleted, pace
from pipeline.objectstore.client import Listed, ObjectStore
from pipeline.settings import Settings
from pipeline.states import RETIRED, REUSABLE, CopyState, Tier

log = logging.getLogger("ckpt.gc")


def claim(session: Session, worker_id: str, shas: list[str]) -> list[str]:
    """Of the objects ``shas`` on ``worker_id``, those no copy row names in a state that holds
    or awaits a file, each claimed as a ``deleting`` copy when its content is known."""
    if not shas:
        return []
    known = {c.sha256: c for c in session.scalars(
        select(Content).where(Content.sha256.in_(shas)).order_by(Content.sha256).with_for_update())}
    rows = {c.sha256: c for c in session.scalars(
        select(ContentCopy).where(ContentCopy.worker_id == worker_id, ContentCopy.sha256.in_(shas)))}
    # Another row at the same bucket and prefix (a target renamed in config.toml keeps its objects
    # under a new row id) names the same objects: one it holds or awaits is nobody's orphan.
    url = select(StorageWorker.url).where(StorageWorker.id == worker_id).scalar_subquery()
    twins = select(StorageWorker.id).where(StorageWorker.tier == Tier.OBJECT_STORE, StorageWorker.url == url,
                                           StorageWorker.id != worker_id)
    named_elsewhere = set(session.scalars(select(ContentCopy.sha256).where(
        ContentCopy.worker_id.in_(twins), ContentCopy.sha256.in_(shas), ContentCopy.state.not_in(sorted(RETIRED)))))
    doomed = []
    for sha in shas:
        row, content = rows.get(sha), known.get(sha)
        if sha in named_elsewhere:
            continue
        if content is None:
            doomed.append(sha)  # no content row, so no copy row: nothing can name it
        elif row is None:
            fresh = new_copy(content, worker_id)
            session.flush()
            move(session, fresh, CopyState.DELETING, error="an orphan in the bucket: deleted by the collection")
            doomed.append(sha)
        elif row.state == CopyState.DELETING or (
                row.state in REUSABLE and move(session, row, CopyState.DELETING, from_=sorted(REUSABLE))):
            doomed.append(sha)
    return doomed


def pages(store: ObjectStore, after: str, size: int) -> Iterator[list[Listed]]:
    """The inventory after ``after``, ``size`` objects at a time."""
    listed = store.inventory(page_size=size, after=after)
    while page := list(islice(listed, size)):
        yield page


def sweep(settings: Settings, job_id: int, worker_id: str, store: ObjectStore,
          params: dict[str, Any]) -> dict[str, Any]:
    """Delete the target's orphans older than the grace, from the job's ``orphan_cursor`` on
    (saved after each page); the job's params when the inventory is done. ObjectStoreError
    leaves the cursor where the last finished page put it."""
    params = {**params, "orphans": params.get("orphans", 0), "orphan_cursor": params.get("orphan_cursor", "")}
    cutoff = now() - timedelta(seconds=settings.gc_orphan_grace_seconds)
    started, done_before = time.monotonic(), params["deleted"]
    for page in pages(store, params["orphan_cursor"], settings.gc_batch):
        old = [o for o in page if o.last_modified is not None and o.last_modified < cutoff]
        with session_scope(settings.db_url) as s:
            doomed = claim(s, worker_id, [o.sha256 for o in old])
        for sha in doomed:
            store.delete(sha)
        sizes = {o.sha256: o.size for o in old}
        with session_scope(settings.db_url) as s:
            for sha in doomed:
                copy_deleted(s, worker_id, sha)
            params.update(orphan_cursor=page[-1].sha256, orphans=params["orphans"] + len(doomed),
                          deleted=params["deleted"] + len(doomed),
                          bytes=params["bytes"] + sum(sizes[sha] for sha in doomed))
            renew_lease(s, job_id, settings.lease_seconds, params=params, bytes_done=params["bytes"])
        if doomed:
            log.info("collection on %s: %d orphan objects deleted", worker_id, len(doomed))
        pace(settings, params["deleted"] - done_before, started)
    return params
