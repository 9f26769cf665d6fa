"""Which queue a message goes to: the host that holds the files it touches (docs/design.md, "Hosts").

Every training host runs Dramatiq workers that consume the shared queue ``ckpt`` and their
own ``ckpt.host.<host>``. A step that reads or deletes a checkpoint's local files goes to the
queue of the host whose disk holds them; a step that only talks to storage workers and the
database goes to the shared queue, where any host takes it. A checkpoint recorded before
hosts were (no host) is any host's, as before.

| actor | where |
|---|---|
| shard, rotate (a store job) | the checkpoint's host |
| replicate (a copy) | the host it names (sent while hashing), else one with a local file holding it; else shared |
| replicate (a copy on an object store a worker can put: it has a good worker copy) | shared |
| rotate_run (a run) | every host with local checkpoints, or parts of checkpoints, in the run |
| rotate_part (a store job, a host) | that host: its part of a rotated checkpoint |
| restore (a restore job) | the host asked for (its destination is there; it has a consumer) |
| repair (a content) | the host it was handed to; else one with a local file if no worker has a good copy; else shared |
| verify, recheck, scrub, reconcile, gc | shared |
"""
from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.copies import good_copy
from pipeline.db.models import (
    Checkpoint,
    CheckpointPart,
    Content,
    ContentCopy,
    Job,
    StorageWorker,
)
from pipeline.hostid import host_queue
from pipeline.states import Tier
from pipeline.steps import Send
from pipeline.store.source import holding_hosts

SHARED = "ckpt"


def depths(client: Any, namespace: str = "dramatiq") -> dict[str, int]:
    """Messages per queue in the broker's Redis (``client``): waiting, being worked on, or
    waiting out a retry's delay; dead letters are not counted (docs/design.md, "Deliveries")."""
    out: dict[str, int] = {}
    prefix = f"{namespace}:"
    for raw in client.scan_iter(match=f"{prefix}*.msgs", count=1000):
        name = (raw.decode() if isinstance(raw, bytes) else str(raw))[len(prefix):-len(".msgs")]
        if name.endswith(".XQ") or name.startswith("__"):
            continue
        queue = name.removesuffix(".DQ")
        out[queue] = out.get(queue, 0) + int(client.hlen(raw))
    return out


def queues_for(session: Session, send: Send) -> list[str]:
    """The queues ``send`` goes to (one, or one per host for a run's rotation)."""
    hosts: list[str | None]
    if send.actor in ("shard", "rotate"):
        hosts = [session.scalar(select(Checkpoint.host).join(Job, Job.checkpoint_id == Checkpoint.id)
                                .where(Job.id == send.args[0]))]
    elif send.actor == "replicate" and len(send.args) > 2 and send.args[2]:
        hosts = [send.args[2]["host"]]  # a file detection is still hashing: only its host has it
    elif send.actor == "replicate":
        sha, tier = session.execute(select(ContentCopy.sha256, StorageWorker.tier)
                                    .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
                                    .where(ContentCopy.id == send.args[0])).one_or_none() or (None, None)
        if sha is not None and tier == Tier.OBJECT_STORE and _has_good_copy(session, sha):
            hosts = [None]  # a worker puts it (pipeline/store/bucket_copy.py): not behind this host's uploads
        else:
            hosts = [_local_host(session, sha)] if sha is not None else [None]
    elif send.actor == "rotate_run":
        hosts = list(session.scalars(select(Checkpoint.host).where(
            Checkpoint.run == send.args[0], Checkpoint.local_present.is_(True)).distinct()))
        hosts += session.scalars(select(CheckpointPart.host).where(
            CheckpointPart.run == send.args[0], CheckpointPart.local_present.is_(True),
            CheckpointPart.checkpoint_id.is_not(None)).distinct())
        hosts = hosts or [None]
    elif send.actor == "rotate_part":
        hosts = [send.args[1]]
    elif send.actor == "restore":
        params = session.scalar(select(Job.params).where(Job.id == send.args[0])) or {}
        hosts = [params.get("host")]
    elif send.actor == "repair":
        sha, params = session.execute(select(Job.sha256, Job.params).where(Job.id == send.args[0])).one_or_none() \
            or (None, None)
        handed = (params or {}).get("host")
        if handed:
            hosts = [handed]  # handed to a host that holds a local file (integrity/repair.py)
        else:
            hosts = [_local_host(session, sha) if sha is not None and not _has_good_copy(session, sha) else None]
    else:
        hosts = [None]
    return sorted({host_queue(h) if h else SHARED for h in hosts})


def _local_host(session: Session, sha: str) -> str | None:
    """A host holding a local file with content ``sha`` (the one whose store is sending it
    first): the checkpoint's host, or the host of the part that holds the file."""
    return (holding_hosts(session, sha) or [None])[0]


def _has_good_copy(session: Session, sha: str) -> bool:
    return session.scalar(
        select(ContentCopy.id).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .join(Content, Content.sha256 == ContentCopy.sha256)
        .where(ContentCopy.sha256 == sha, good_copy()).limit(1)) is not None
