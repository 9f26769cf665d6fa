"""What `ckpt status`, the web UI and ``/metrics`` show of the object-store tier.

Each target on its own (its state, what its copy rows hold against its quota, how many copies),
and per checkpoint whose run wants object-store copies how many of its contents are confirmed
there (a good copy on ``target_copies`` object stores, pipeline.db.copies.good_copy of tier
``objectstore``), so a lagging copy is visible; per shard (the web UI's checkpoint page) its copy
state there. Each is one grouped query over the page's checkpoints or the target rows, never
one per row.
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline.core.copies import Copy
from pipeline.core.health import COUNTS, worker_healths
from pipeline.db.copies import good_copy, held_per_worker
from pipeline.db.models import Checkpoint, CheckpointFile, Content, ContentCopy, Shard, StorageWorker
from pipeline.objectstore.config import row_id
from pipeline.settings import Settings
from pipeline.states import ContentState, CopyState, Tier


def targets(session: Session, settings: Settings | None = None,
            held: dict[str, tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """Every object-store row: id, url, state, used bytes (its held copies) against its quota
    (``capacity_bytes``; 0: none), copies, last error; with ``settings``, also the ``endpoint``
    its target is configured with (``""``: AWS S3 itself; None: no longer configured).
    ``held``: pipeline.db.copies.held_per_worker's answer, when the caller has it (a page that
    lists both tiers counts what each row holds once)."""
    rows = list(session.scalars(select(StorageWorker).where(StorageWorker.tier == Tier.OBJECT_STORE)
                                .order_by(StorageWorker.id)))
    if held is None:  # these rows' copies only, along the (worker, state) index: not the workers' too
        held = held_per_worker(session, [w.id for w in rows]) if rows else {}
    endpoints = {row_id(t.name): t.endpoint for t in settings.object_targets()} if settings is not None else None
    out: list[dict[str, Any]] = []
    for w in rows:
        copies, used = held.get(w.id, (0, 0))
        out.append({"id": w.id, "url": w.url, "state": w.state, "used_bytes": used,
                    "quota_bytes": w.capacity_bytes or 0, "copies": copies, "last_error": w.last_error})
        if endpoints is not None:
            out[-1]["endpoint"] = endpoints.get(w.id)
    return out


def confirmed(session: Session, settings: Settings, ckpts: list[Checkpoint]) -> dict[int, dict[str, Any]]:
    """Per checkpoint whose run wants object-store copies: ``contents``, how many are
    ``confirmed`` (``wanted`` good copies on object stores) and the run's ``mode``
    (``lag``: rotation does not wait for them; ``required``)."""
    policy = {c.id: settings.target_policy(c.run) for c in ckpts}
    ids = [cid for cid, (n, _mode) in policy.items() if n > 0]
    if not ids:
        return {}
    pairs = (select(CheckpointFile.checkpoint_id.label("cid"), Shard.sha256.label("sha"))
             .join(Shard, Shard.file_id == CheckpointFile.id)
             .where(CheckpointFile.checkpoint_id.in_(ids)).distinct().subquery())
    # The good copies of these checkpoints' contents only: grouped over every copy row, this
    # read the whole table for a page of 50 (~140 ms at 100k checkpoints).
    good = (select(ContentCopy.sha256, func.count().label("n"))
            .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .join(Content, Content.sha256 == ContentCopy.sha256)
            .where(ContentCopy.sha256.in_(select(pairs.c.sha)), good_copy(tier=Tier.OBJECT_STORE))
            .group_by(ContentCopy.sha256).subquery())
    rows = session.execute(select(pairs.c.cid, func.coalesce(good.c.n, 0))
                           .outerjoin(good, good.c.sha256 == pairs.c.sha)).all()
    out: dict[int, dict[str, Any]] = {cid: {"contents": 0, "confirmed": 0, "wanted": policy[cid][0],
                                            "mode": policy[cid][1]} for cid in ids}
    for cid, n in rows:
        out[cid]["contents"] += 1
        out[cid]["confirmed"] += int(n >= policy[cid][0])
    return out


#: A shard's object-store copy state when it is not confirmed, worst first: a copy found damaged
#: (corrupt; missing: absent from the store, on a store that cannot be read, or never placed),
#: then one on its way (pending: placed or sent, not confirmed yet).
_NOT_CONFIRMED = ("corrupt", "missing", "pending")


def shard(copies: Iterable[Copy], since: datetime, wanted: int) -> dict[str, Any]:
    """One shard's copy state on the object stores, from every copy row of its content (as
    pipeline.db.copies.content_copies reads them): ``confirmed`` when ``wanted`` object stores
    hold a good copy (the rule :func:`confirmed` counts), else the worst of ``corrupt``,
    ``missing`` (none placed, or not there) and ``pending``; ``cells``: each object store's copy
    health (pipeline.core.health.worker_healths of tier ``objectstore``)."""
    cells = worker_healths(copies, since, Tier.OBJECT_STORE)
    good = sum(1 for h in cells.values() if h in COUNTS)
    if good >= max(wanted, 1):
        state = "confirmed"
    else:
        seen = {"pending" if h in ("unverified", "draining") else h for h in cells.values()}
        state = next((h for h in _NOT_CONFIRMED if h in seen), "missing")
    return {"state": state, "confirmed": good, "wanted": wanted, "cells": cells}


def lagging_contents(session: Session) -> int:
    """Live contents placed on an object store and not confirmed there yet (a copy ``pending``
    or ``stored``): what the object-store sweep still has to send or confirm."""
    return int(session.scalar(
        select(func.count(func.distinct(ContentCopy.sha256)))
        .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .join(Content, Content.sha256 == ContentCopy.sha256)
        .where(StorageWorker.tier == Tier.OBJECT_STORE, Content.state == ContentState.LIVE,
               ContentCopy.state.in_((CopyState.PENDING, CopyState.STORED)))) or 0)


def words(o: dict[str, Any]) -> str:
    """``object store: 12/14 contents confirmed, lagging`` (``required`` when rotation waits for them)."""
    if o["confirmed"] >= o["contents"]:
        return f"object store: {o['confirmed']}/{o['contents']} contents confirmed"
    how = "required" if o["mode"] == "required" else "lagging"
    return f"object store: {o['confirmed']}/{o['contents']} contents confirmed, {how}"
