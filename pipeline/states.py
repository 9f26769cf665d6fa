"""States as data: jobs and their transitions, replicas, storage workers, and their groups.

Who sets each state is written beside it. :func:`pipeline.db.transitions.transition` is
the only code that moves a job, and it consults :data:`TRANSITIONS`. Replica and worker
states are set by the steps named beside them; the groups below are the only place that
says which states count toward the replication factor, which can be read, and so on
(docs/design.md, "States").
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
    SUPERSEDED = "superseded"  # catalog, shard, replicate: new content at the path (a newer version)
    VANISHED = "vanished"      # watcher, shard, replicate: the local copy was deleted before it was protected


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
        _S.DETECTED: frozenset({_S.SHARDED, _S.FAILED, _S.SUPERSEDED, _S.VANISHED}),
        _S.SHARDED: frozenset({_S.REPLICATED, _S.FAILED, _S.SUPERSEDED, _S.VANISHED}),
        # A replica found missing, corrupt or unreachable at verify is replaced: back to sharded.
        _S.REPLICATED: frozenset({_S.VERIFIED, _S.SHARDED, _S.FAILED, _S.SUPERSEDED, _S.VANISHED}),
        # New content at the path makes every older version superseded, protected or not.
        _S.VERIFIED: frozenset({_S.ROTATED, _S.SUPERSEDED}),
        _S.ROTATED: frozenset({_S.SUPERSEDED}),
        # A failed job can be requeued from the dead-letter queue: it resumes where it was.
        _S.FAILED: frozenset({_S.DETECTED, _S.SHARDED, _S.REPLICATED, _S.VERIFIED, _S.SUPERSEDED, _S.VANISHED}),
        _S.SUPERSEDED: frozenset(),
        _S.VANISHED: frozenset(),
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

INITIAL: dict[str, str] = {JobKind.STORE.value: _S.DETECTED.value, JobKind.RESTORE.value: _R.QUEUED.value,
                           JobKind.SCRUB.value: _C.QUEUED.value, JobKind.REPAIR.value: _P.QUEUED.value}

#: States in which nothing more happens without a person (or a new checkpoint) asking.
TERMINAL: dict[str, frozenset[str]] = {
    JobKind.STORE.value: frozenset({_S.ROTATED.value, _S.FAILED.value, _S.SUPERSEDED.value, _S.VANISHED.value}),
    JobKind.RESTORE.value: frozenset({_R.DONE.value, _R.FAILED.value}),
    JobKind.SCRUB.value: frozenset({_C.DONE.value, _C.FAILED.value}),
    JobKind.REPAIR.value: frozenset({_P.DONE.value, _P.LOST.value, _P.FAILED.value}),
}

#: States in which an actor is expected to be working, so an expired lease means lost work.
ACTIVE: dict[str, frozenset[str]] = {
    JobKind.STORE.value: frozenset({_S.DETECTED.value, _S.SHARDED.value, _S.REPLICATED.value}),
    JobKind.RESTORE.value: frozenset({_R.QUEUED.value, _R.GATHERING.value, _R.VERIFIED.value}),
    JobKind.SCRUB.value: frozenset({_C.QUEUED.value, _C.SCRUBBING.value}),
    JobKind.REPAIR.value: frozenset({_P.QUEUED.value, _P.REPAIRING.value}),
}

#: Store states of a checkpoint whose remote copies are complete and verified.
PROTECTED: frozenset[str] = frozenset({_S.VERIFIED.value, _S.ROTATED.value})
#: Store states from which a checkpoint can be given back.
RESTORABLE: frozenset[str] = frozenset({_S.REPLICATED.value, _S.VERIFIED.value, _S.ROTATED.value})


def allowed(kind: str, current: str, target: str) -> bool:
    """Tell whether the state machine of ``kind`` has the edge ``current -> target``."""
    return str(target) in TRANSITIONS[str(kind)].get(str(current), frozenset())


def all_states(kind: str) -> frozenset[str]:
    """Every state a job of ``kind`` can be in."""
    return frozenset(TRANSITIONS[str(kind)])


class ReplicaState(StrEnum):
    """One shard's copy on one storage worker (a row of ``replicas``)."""

    PENDING = "pending"      # shard step, repair, verify (a replacement): placed, not stored yet
    STORED = "stored"        # replicate: stored, but its re-hash did not match yet (verify replaces it)
    VERIFIED = "verified"    # replicate, verify, scrub, repair: the worker's re-hash matched the manifest
    CORRUPT = "corrupt"      # verify, scrub, repair: the re-hash did not match (quarantined by repair)
    MISSING = "missing"      # scrub, reconcile, repair: the worker does not hold it
    ABANDONED = "abandoned"  # replicate, verify: given up for a copy on another worker
    TRIMMED = "trimmed"      # reconcile: a surplus copy, deleted from its worker


_Rep = ReplicaState

#: Copies the worker should hold a file for: scrub and reconcile check them.
HELD: frozenset[str] = frozenset({_Rep.STORED.value, _Rep.VERIFIED.value, _Rep.CORRUPT.value,
                                  _Rep.MISSING.value})
#: Copies the manifest expects on a worker (reconcile): held ones and those being sent.
EXPECTED: frozenset[str] = HELD | {_Rep.PENDING.value}
#: Copies a restore may read, best first (the file's and each shard's SHA-256 check them).
READABLE_COPIES: tuple[str, ...] = (_Rep.VERIFIED.value, _Rep.STORED.value)
#: Copies that are done being sent (replicate's fan-in waits for no PENDING).
SENT: frozenset[str] = frozenset({_Rep.STORED.value, _Rep.VERIFIED.value})
#: Copies found damaged: whatever other rows of the same content say, that worker's copy is not good.
DAMAGED: frozenset[str] = frozenset({_Rep.CORRUPT.value, _Rep.MISSING.value})
#: Rows kept for the history only: not shown as copies, never counted.
RETIRED: frozenset[str] = frozenset({_Rep.ABANDONED.value, _Rep.TRIMMED.value})


class WorkerState(StrEnum):
    """A storage worker as the control plane sees it (a row of ``storage_workers``)."""

    CANDIDATE = "candidate"  # discovery (mDNS): found, not yet challenged
    UP = "up"                # membership: proved it holds the cluster key and answers
    DOWN = "down"            # membership (unseen for worker_down_seconds); replicate, verify (unreachable)
    REJECTED = "rejected"    # membership: failed the cluster-key challenge
    DRAINING = "draining"    # an operator (`ckpt worker drain`): its copies are being moved away
    REMOVABLE = "removable"  # scheduler: drained, every shard it held has RF good copies elsewhere


_W = WorkerState

#: Workers whose copies count toward RF, and that placement may choose.
COUNTING_WORKERS: frozenset[str] = frozenset({_W.UP.value})
#: Workers a copy can be read from (a draining worker still serves its copies).
READABLE_WORKERS: frozenset[str] = frozenset({_W.UP.value, _W.DRAINING.value})
#: Workers a scrub re-hashes.
SCRUBBED_WORKERS: frozenset[str] = READABLE_WORKERS
#: States an operator decided: a probe does not override them.
STICKY_WORKERS: frozenset[str] = frozenset({_W.DRAINING.value, _W.REMOVABLE.value})
