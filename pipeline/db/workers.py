"""The one function that changes a storage worker's state, and the one that records a new worker.

:func:`set_state` follows :data:`pipeline.states.WORKER_MOVES` (a repeat is no move; any other
move the table lacks raises :class:`~pipeline.errors.InvalidMove`). :func:`observe` is how a
health observation (a probe, an unreachable or full worker) is recorded: it moves the worker
only where the table allows, so an operator's ``draining`` or ``removable`` outranks it (the
sticky rule), and records the error either way. The caller owns the transaction.
"""
from __future__ import annotations

from typing import Final

from sqlalchemy import delete
from sqlalchemy.orm import Session

from pipeline.db.engine import rowcount
from pipeline.db.models import ContentCopy, StorageWorker
from pipeline.errors import InvalidMove
from pipeline.states import UNDRAIN_MOVES, WORKER_INITIAL, WorkerState, worker_may


class _Keep:
    """The ``error`` of a move that leaves ``last_error`` as it is."""


KEEP: Final = _Keep()


def add(session: Session, worker_id: str, url: str, *, source: str, zone: str = "") -> StorageWorker:
    """Record a worker found at ``url`` (by ``source``: "static", "local", "mdns"), in the initial
    state (``candidate``): only a proof of the cluster key admits it."""
    worker = StorageWorker(id=worker_id, url=url, zone=zone, source=source, state=WORKER_INITIAL)
    session.add(worker)
    return worker


def may(worker: StorageWorker, to: str) -> bool:
    """Whether :func:`set_state` would accept moving ``worker`` to ``to`` (a repeat is accepted)."""
    return worker_may(worker.state, to)


def set_state(session: Session, worker: StorageWorker, to: str, *, error: str | None | _Keep = KEEP,
              operator: bool = False) -> bool:
    """Move ``worker`` to ``to``; True if it moved (False: it was there already).

    ``error`` becomes its ``last_error`` (None clears it; by default it is kept). Raises
    :class:`~pipeline.errors.InvalidMove` for a move :data:`~pipeline.states.WORKER_MOVES` lacks.
    ``operator``: an operator's undrain, which may also take :data:`~pipeline.states.UNDRAIN_MOVES`.
    """
    target = WorkerState(to)
    undrain = operator and target in UNDRAIN_MOVES.get(WorkerState(worker.state), frozenset())
    if not undrain and not worker_may(worker.state, target):
        raise InvalidMove(f"storage worker {worker.id}", worker.state, target)
    if not isinstance(error, _Keep):
        worker.last_error = error
    if worker.state == target:
        return False
    worker.state = target
    return True


def observe(session: Session, worker: StorageWorker, to: str, *, error: str | None | _Keep = KEEP) -> bool:
    """Record what a probe or a request found (``to``: up, full, down, rejected): the worker moves
    if the table allows it (never out of an operator's ``draining`` or ``removable``), and
    ``error`` is recorded either way; True if it moved."""
    if not may(worker, to):
        if not isinstance(error, _Keep):
            worker.last_error = error
        return False
    return set_state(session, worker, to, error=error)


def remove(session: Session, worker: StorageWorker) -> int:
    """Forget ``worker`` and its copy rows (an operator's ``ckpt workers remove``, after
    :func:`pipeline.operations.remove` checked that nothing depends on it); how many copy rows went."""
    gone = session.execute(delete(ContentCopy).where(ContentCopy.worker_id == worker.id))
    session.delete(worker)
    return rowcount(gone)


__all__ = ["KEEP", "add", "may", "observe", "remove", "set_state"]
