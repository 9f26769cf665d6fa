"""The verify step: ``replicated -> verified``.

Each storage worker re-hashes its replicas from its disk; the answers are compared to the
manifest's SHA-256, never to anything the worker says about itself (DESIGN invariant 4).
A missing replica is sent again; a corrupt one is replaced on another worker and the job
goes back to ``sharded`` until the replacement is stored.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import select

from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Replica, Shard, StorageWorker
from pipeline.db.transitions import now, transition
from pipeline.errors import WorkerError
from pipeline.settings import Settings
from pipeline.replicas import place_replacement
from pipeline.steps import Send, begin_step
from pipeline.worker_client import WorkerClient

log = logging.getLogger("ckpt.verify")
S = states.StoreState


def replicas_of(session, checkpoint_id: int, states_: tuple[str, ...]) -> list[Replica]:  # noqa: ANN001
    return list(session.scalars(
        select(Replica).join(Shard).join(CheckpointFile)
        .where(CheckpointFile.checkpoint_id == checkpoint_id, Replica.state.in_(states_))
        .order_by(Replica.id)
    ))


def rehash_on_workers(settings: Settings, by_worker: dict[str, tuple[str, list[str]]]) -> dict[str, dict[str, str | None] | str]:
    """Ask each worker (id -> (url, names)) to re-hash its shards.

    Returns id -> {name: sha256 or None if absent}, or id -> error text if it could not answer.
    """
    key = settings.key()

    def ask(item: tuple[str, tuple[str, list[str]]]) -> tuple[str, dict[str, str | None] | str]:
        worker_id, (url, names) = item
        try:
            results = WorkerClient(url, key).verify(sorted(set(names)))
        except WorkerError as exc:
            log.warning("verify on %s failed: %s", worker_id, exc)
            return worker_id, exc.reason
        return worker_id, {r["name"]: r["sha256"] for r in results}

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(by_worker)))) as pool:
        return dict(pool.map(ask, by_worker.items()))


def replace_replica(session, rep: Replica, state: str, error: str) -> Replica:  # noqa: ANN001
    """Stop counting ``rep`` and place a fresh replica of its shard on another live worker."""
    rep.state, rep.last_error = state, error
    return place_replacement(session, rep.shard)


def verify_checkpoint(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = begin_step(s, settings, job_id, S.REPLICATED)
        if job is None:
            return []
        checkpoint_id = job.checkpoint_id
        by_worker: dict[str, tuple[str, list[str]]] = {}
        for rep in replicas_of(s, checkpoint_id, ("stored", "verified")):
            url, names = by_worker.setdefault(rep.worker_id, (rep.worker.url, []))
            names.append(rep.shard.sha256)

    answers = rehash_on_workers(settings, by_worker)

    sends: list[Send] = []
    with session_scope(settings.db_url) as s:
        t = now()
        bad: list[str] = []
        for worker_id, answer in answers.items():
            if isinstance(answer, str):
                worker = s.get(StorageWorker, worker_id)
                worker.state, worker.last_error = "down", answer
        for rep in replicas_of(s, checkpoint_id, ("stored", "verified")):
            answer = answers[rep.worker_id]
            if isinstance(answer, str):  # unreachable: its copies do not count; copy elsewhere
                fresh = replace_replica(s, rep, "abandoned", f"worker unreachable at verify: {answer}")
                bad.append(f"shard {rep.shard.sha256[:12]} unreachable on {rep.worker_id}")
                sends.append(Send("replicate", (fresh.id,)))
                continue
            actual = answer.get(rep.shard.sha256)
            if actual == rep.shard.sha256:
                rep.state, rep.verified_at, rep.last_error = "verified", t, None
            elif actual is None:
                rep.state, rep.last_error = "pending", "missing on the worker at verify"
                bad.append(f"shard {rep.shard.sha256[:12]} missing on {rep.worker_id}")
                sends.append(Send("replicate", (rep.id,)))
            else:
                fresh = replace_replica(s, rep, "corrupt", f"worker re-hash gave {actual}")
                bad.append(f"shard {rep.shard.sha256[:12]} corrupt on {rep.worker_id}")
                sends.append(Send("replicate", (fresh.id,)))
        if bad:
            transition(s, job_id, "store", S.REPLICATED, S.SHARDED, lease_seconds=settings.lease_seconds,
                       detail="re-replicating: " + "; ".join(bad[:10]))
            return sends
        run = s.get(Checkpoint, checkpoint_id).run
        transition(s, job_id, "store", S.REPLICATED, S.VERIFIED,
                   detail=f"{sum(len(n) for _, n in by_worker.values())} replicas re-hashed and matched")
        log.info("job %d verified on %d workers", job_id, len(by_worker))
    return [Send("rotate_run", (run,))]


