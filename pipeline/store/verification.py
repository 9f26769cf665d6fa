"""The verify step: ``replicated -> verified``.

Each storage worker re-hashes its replicas from its disk; the answers are compared to the
manifest's SHA-256, never to anything the worker says about itself (docs/design.md, invariant 4).
Replicas that the replicate step already re-hashed and matched during this job (most of
them: each is re-hashed as soon as it is stored) are not read again; their workers only
confirm that they still hold them, so a worker lost since then is still caught here.
A missing replica is sent again; a corrupt one is replaced on another worker and the job
goes back to ``sharded`` until the replacement is stored.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Replica, Shard, StorageWorker
from pipeline.db.replicas import mark, place_replacement
from pipeline.db.transitions import now, transition
from pipeline.errors import WorkerError
from pipeline.settings import Settings
from pipeline.states import JobKind, ReplicaState, WorkerState
from pipeline.steps import Send, begin_step

log = logging.getLogger("ckpt.verify")
S = states.StoreState


def replicas_of(session: Session, checkpoint_id: int, wanted: Iterable[str]) -> list[Replica]:
    return list(session.scalars(
        select(Replica).join(Shard).join(CheckpointFile)
        .where(CheckpointFile.checkpoint_id == checkpoint_id, Replica.state.in_(sorted(wanted)))
        .order_by(Replica.id)
    ))


@dataclass
class WorkerAsk:
    url: str
    #: shards to re-hash from the disk
    rehash: list[str] = field(default_factory=list)
    #: shards re-hashed when they were stored: only confirm they are still there (name -> size)
    present: dict[str, int] = field(default_factory=dict)


def rehash_on_workers(settings: Settings, asks: dict[str, WorkerAsk]) -> dict[str, dict[str, str | None] | str]:
    """Ask each worker to re-hash some of its shards and to confirm that others are held.

    Returns id -> {name: sha256 from the disk (a confirmed one: its own name, or its wrong
    size), or None if absent}, or id -> error text if the worker could not answer.
    """
    key = settings.key()

    def ask(item: tuple[str, WorkerAsk]) -> tuple[str, dict[str, str | None] | str]:
        worker_id, a = item
        client = WorkerClient(a.url, key)
        try:
            out: dict[str, str | None] = {}
            if a.present:
                sizes = client.stat(sorted(a.present))
                out.update({n: n if sizes.get(n) == size else (None if sizes.get(n) is None
                                                                else f"{sizes[n]:,} bytes, not {size:,}")
                            for n, size in a.present.items()})
            if a.rehash:
                out.update({r["name"]: r["sha256"] for r in client.verify(sorted(set(a.rehash)))})
        except WorkerError as exc:
            log.warning("verify on %s failed: %s", worker_id, exc)
            return worker_id, exc.reason
        return worker_id, out

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(asks)))) as pool:
        return dict(pool.map(ask, asks.items()))


def replace_replica(session: Session, rep: Replica, state: str, error: str) -> Replica:
    """Stop counting ``rep`` and place a fresh replica of its shard on another live worker."""
    rep.state, rep.last_error = state, error
    return place_replacement(session, rep.shard)


def verify_checkpoint(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = begin_step(s, settings, job_id, S.REPLICATED)
        if job is None:
            return []
        checkpoint_id, since = one(s, Checkpoint, job.checkpoint_id).id, job.created_at
        asks: dict[str, WorkerAsk] = {}
        confirmed: set[int] = set()
        for rep in replicas_of(s, checkpoint_id, states.SENT):
            a = asks.setdefault(rep.worker_id, WorkerAsk(rep.worker.url))
            if rep.state == ReplicaState.VERIFIED and rep.verified_at is not None and rep.verified_at >= since:
                a.present[rep.shard.sha256] = rep.shard.size  # re-hashed when stored, this job
                confirmed.add(rep.id)
            else:
                a.rehash.append(rep.shard.sha256)

    answers = rehash_on_workers(settings, asks)

    sends: list[Send] = []
    with session_scope(settings.db_url) as s:
        t = now()
        bad: list[str] = []
        for worker_id, answer in answers.items():
            if isinstance(answer, str):
                worker = one(s, StorageWorker, worker_id)
                worker.state, worker.last_error = WorkerState.DOWN, answer
        for rep in replicas_of(s, checkpoint_id, states.SENT):
            answer = answers[rep.worker_id]
            if isinstance(answer, str):  # unreachable: its copies do not count; copy elsewhere
                fresh = replace_replica(s, rep, ReplicaState.ABANDONED, f"worker unreachable at verify: {answer}")
                bad.append(f"shard {rep.shard.sha256[:12]} unreachable on {rep.worker_id}")
                sends.append(Send("replicate", (fresh.id,)))
                continue
            actual = answer.get(rep.shard.sha256)
            if actual == rep.shard.sha256:
                rep.state, rep.last_error = ReplicaState.VERIFIED, None
                if rep.id not in confirmed:
                    rep.verified_at = t
            elif actual is None:
                # The file is what is missing: every row of this content on that worker says so.
                mark(s, rep.worker_id, rep.shard.sha256, state=ReplicaState.MISSING, checked_at=t,
                     last_error="missing on the worker at verify")
                rep.state, rep.last_error = ReplicaState.PENDING, "missing on the worker at verify"
                bad.append(f"shard {rep.shard.sha256[:12]} missing on {rep.worker_id}")
                sends.append(Send("replicate", (rep.id,)))
            else:
                mark(s, rep.worker_id, rep.shard.sha256, state=ReplicaState.CORRUPT, checked_at=t,
                     last_error=f"at verify the worker gave {actual}")
                fresh = replace_replica(s, rep, ReplicaState.CORRUPT, f"at verify the worker gave {actual}")
                bad.append(f"shard {rep.shard.sha256[:12]} corrupt on {rep.worker_id}")
                sends.append(Send("replicate", (fresh.id,)))
        if bad:
            transition(s, job_id, JobKind.STORE, S.REPLICATED, S.SHARDED, lease_seconds=settings.lease_seconds,
                       detail="re-replicating: " + "; ".join(bad[:10]))
            return sends
        run = one(s, Checkpoint, checkpoint_id).run
        transition(s, job_id, JobKind.STORE, S.REPLICATED, S.VERIFIED,
                   detail=f"{len(confirmed) + sum(len(a.rehash) for a in asks.values())} replicas re-hashed and"
                          f" matched ({len(confirmed)} as they were stored)")
        log.info("job %d verified on %d workers", job_id, len(asks))
    return [Send("rotate_run", (run,))]


