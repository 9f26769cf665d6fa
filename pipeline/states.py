"""Job states and the transitions between them, declared once as data.

Who sets each state is written beside it; :func:`pipeline.db.transitions.transition`
is the only code that moves a job, and it consults :data:`TRANSITIONS`.
"""
from __future__ import annotations

from enum import StrEnum


class JobKind(StrEnum):
    STORE = "store"
    RESTORE = "restore"
    SCRUB = "scrub"
    REPAIR = "repair"


class StoreState(StrEnum):
    DETECTED = "detected"      # watcher / CLI / HTTP: files and whole-file SHA-256 recorded
    SHARDED = "sharded"        # shard actor: manifest committed, replicas placed
    REPLICATED = "replicated"  # replicate actors (fan-in decided in the database)
    VERIFIED = "verified"      # verify actor: every replica re-hashed and matched
    ROTATED = "rotated"        # rotate actor: local copy removed, replicas remain
    FAILED = "failed"          # retries exhausted; message in the dead-letter queue
    SUPERSEDED = "superseded"  # the source changed underneath the pipeline


class RestoreState(StrEnum):
    QUEUED = "queued"          # CLI / HTTP
    GATHERING = "gathering"    # restore actor: fetching shards
    VERIFIED = "verified"      # restore actor: every file matched its recorded SHA-256
    DONE = "done"              # restore actor: renamed into place
    FAILED = "failed"          # retries exhausted


class ScrubState(StrEnum):
    QUEUED = "queued"          # scheduler (nightly) / CLI / HTTP: one job per storage worker
    SCRUBBING = "scrubbing"    # scrub actor: re-hashing the worker's replicas from a cursor
    DONE = "done"              # scrub actor: every replica checked against the manifest
    FAILED = "failed"          # retries exhausted


class RepairState(StrEnum):
    QUEUED = "queued"          # scrub / verify / scheduler (under-replicated or drained shards)
    REPAIRING = "repairing"    # repair actor: copying from a replica that matches the manifest
    DONE = "done"              # repair actor: every shard of the checkpoint back at RF, verified
    LOST = "lost"              # repair actor: some shard has no copy that matches the manifest
    FAILED = "failed"          # retries exhausted


_S, _R, _C, _P = StoreState, RestoreState, ScrubState, RepairState


def _edges(table: dict) -> dict[str, frozenset[str]]:
    # Enum members hash by name, not value: key the tables by plain strings.
    return {str(k.value): frozenset(str(t.value) for t in v) for k, v in table.items()}


TRANSITIONS: dict[str, dict[str, frozenset[str]]] = {
    JobKind.STORE.value: _edges({
        _S.DETECTED: frozenset({_S.SHARDED, _S.FAILED, _S.SUPERSEDED}),
        _S.SHARDED: frozenset({_S.REPLICATED, _S.FAILED, _S.SUPERSEDED}),
        # A replica found missing, corrupt or unreachable at verify is replaced: back to sharded.
        _S.REPLICATED: frozenset({_S.VERIFIED, _S.SHARDED, _S.FAILED}),
        _S.VERIFIED: frozenset({_S.ROTATED}),
        _S.ROTATED: frozenset(),
        # A failed job can be requeued from the dead-letter queue: it resumes where it was.
        _S.FAILED: frozenset({_S.DETECTED, _S.SHARDED, _S.REPLICATED, _S.VERIFIED}),
        _S.SUPERSEDED: frozenset(),
    }),
    JobKind.RESTORE.value: _edges({
        _R.QUEUED: frozenset({_R.GATHERING, _R.FAILED}),
        _R.GATHERING: frozenset({_R.VERIFIED, _R.FAILED}),
        _R.VERIFIED: frozenset({_R.DONE, _R.FAILED}),
        _R.DONE: frozenset(),
        _R.FAILED: frozenset({_R.QUEUED}),
    }),
    JobKind.SCRUB.value: _edges({
        _C.QUEUED: frozenset({_C.SCRUBBING, _C.FAILED}),
        _C.SCRUBBING: frozenset({_C.DONE, _C.FAILED}),
        _C.DONE: frozenset(),
        _C.FAILED: frozenset({_C.QUEUED}),
    }),
    JobKind.REPAIR.value: _edges({
        _P.QUEUED: frozenset({_P.REPAIRING, _P.FAILED}),
        _P.REPAIRING: frozenset({_P.DONE, _P.LOST, _P.FAILED}),
        _P.DONE: frozenset(),
        # A lost shard is looked at again when a copy may have come back (a worker returned).
        _P.LOST: frozenset({_P.QUEUED}),
        _P.FAILED: frozenset({_P.QUEUED}),
    }),
}

INITIAL: dict[str, str] = {"store": _S.DETECTED.value, "restore": _R.QUEUED.value,
                           "scrub": _C.QUEUED.value, "repair": _P.QUEUED.value}

#: States in which nothing more happens without a person (or a new checkpoint) asking.
TERMINAL: dict[str, frozenset[str]] = {
    "store": frozenset({_S.ROTATED.value, _S.FAILED.value, _S.SUPERSEDED.value}),
    "restore": frozenset({_R.DONE.value, _R.FAILED.value}),
    "scrub": frozenset({_C.DONE.value, _C.FAILED.value}),
    "repair": frozenset({_P.DONE.value, _P.LOST.value, _P.FAILED.value}),
}

#: States in which an actor is expected to be working, so an expired lease means lost work.
ACTIVE: dict[str, frozenset[str]] = {
    "store": frozenset({_S.DETECTED.value, _S.SHARDED.value, _S.REPLICATED.value}),
    "restore": frozenset({_R.QUEUED.value, _R.GATHERING.value, _R.VERIFIED.value}),
    "scrub": frozenset({_C.QUEUED.value, _C.SCRUBBING.value}),
    "repair": frozenset({_P.QUEUED.value, _P.REPAIRING.value}),
}


def allowed(kind: str, current: str, target: str) -> bool:
    """Tell whether the state machine of ``kind`` has the edge ``current -> target``."""
    return str(target) in TRANSITIONS[str(kind)].get(str(current), frozenset())


def all_states(kind: str) -> frozenset[str]:
    """Every state a job of ``kind`` can be in."""
    return frozenset(TRANSITIONS[str(kind)])
