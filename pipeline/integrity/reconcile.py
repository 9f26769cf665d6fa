"""Reconciling a storage worker that came back: what it holds is checked before it counts.

Replicas the manifest expects there are re-hashed and count again if they match; files
that match nothing the manifest expects there, or that hash wrong, are quarantined; copies
that are now surplus (every shard with that content has more than RF verified copies on
live workers) are trimmed from the returning worker.
"""
from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db.engine import session_scope
from pipeline.db.models import Replica, Shard, StorageWorker
from pipeline.db.replicas import mark, shas_on
from pipeline.db.transitions import now
from pipeline.integrity.repair import request_repair
from pipeline.integrity.scrub import checkpoints_of, record_rehash
from pipeline.settings import Settings
from pipeline.states import ReplicaState, WorkerState
from pipeline.steps import Send

log = logging.getLogger("ckpt.reconcile")


def reconcile_worker(settings: Settings, worker_id: str) -> list[Send]:
    with session_scope(settings.db_url) as s:
        worker = s.get(StorageWorker, worker_id)
        if worker is None or worker.state != WorkerState.UP:
            return []
        client = WorkerClient(worker.url, settings.key())
        expected = set(shas_on(s, worker_id, states.EXPECTED))
    held = {name for name, _size in client.inventory()}
    unknown = sorted(held - expected)
    check = sorted(held & expected)
    answers = {r["name"]: r for r in client.verify(check, rate=settings.scrub_rate)} if check else {}
    absent = sorted(expected - held)

    sends: list[Send] = []
    with session_scope(settings.db_url) as s:
        t = now()
        bad = record_rehash(s, worker_id, answers, t)
        for name in absent:
            mark(s, worker_id, name, states=states.SENT, state=ReplicaState.MISSING, checked_at=t,
                 last_error="absent when the worker came back")
        for checkpoint_id in checkpoints_of(s, worker_id, bad + absent):
            job = request_repair(s, settings, checkpoint_id, f"{worker_id} came back without good copies")
            if job is not None:
                sends.append(Send("repair", (job.id,)))
        corrupt = [n for n in bad if answers[n]["sha256"] is not None]
        surplus = [n for n in check if n not in bad and _surplus(s, n, settings.rf)]
        for name in surplus:
            mark(s, worker_id, name, states=(ReplicaState.VERIFIED,), state=ReplicaState.TRIMMED,
                 last_error="surplus copy trimmed")
    if unknown or corrupt:
        client.quarantine(unknown + corrupt)
    for name in surplus:
        client.delete(name)
    log.info("reconciled %s: %d held, %d matched, %d bad, %d unknown quarantined, %d surplus trimmed",
             worker_id, len(held), len(check) - len(bad), len(bad), len(unknown), len(surplus))
    return sends


def _surplus(s: Session, sha: str, rf: int) -> bool:
    """True when every shard with this content keeps more than RF verified copies on live workers."""
    per_shard = (
        select(Shard.id, func.count(func.distinct(Replica.worker_id)).label("n"))
        .join(Replica, Replica.shard_id == Shard.id)
        .join(StorageWorker, StorageWorker.id == Replica.worker_id)
        .where(Shard.sha256 == sha, Replica.state == ReplicaState.VERIFIED, StorageWorker.state == WorkerState.UP)
        .group_by(Shard.id)
    ).subquery()
    counts = list(s.scalars(select(per_shard.c.n)))
    total = s.scalar(select(func.count(Shard.id)).where(Shard.sha256 == sha))
    return bool(counts) and len(counts) == total and min(counts) > rf
