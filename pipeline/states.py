"""States as data: jobs, copies and storage workers, the moves each may make, and their groups.

Who sets each state is written beside it. One function moves each lifecycle and consults its
table: :func:`pipeline.db.transitions.transition` a job (:data:`TRANSITIONS`),
:func:`pipeline.db.copies.move` a copy (:data:`COPY_MOVES`), :func:`pipeline.db.workers.set_state`
a storage worker (:data:`WORKER_MOVES`). The groups below are the only place that says which
states count toward the replication factor, which can be read, and so on (docs/design.md, "States").
"""
from __future__ import annotations

from enum import StrEnum


class JobKind(StrEnum):
    STORE = "store"          # one checkpoint version: shard, replicate, verify, rotate
    RESTORE = "restore"      # one checkpoint back to a destination
    SCRUB = "scrub"          # one storage worker: re-hash every copy it holds
    REPAIR = "repair"        # one content: back to RF good copies
    RECONCILE = "reconcile"  # one storage worker that came back: its inventory against the copies
    GC = "gc"                # one storage worker: delete the copies of condemned content


class StoreState(StrEnum):
    DETECTED = "detected"      # watcher / CLI / HTTP: files and whole-file SHA-256 recorded
    WAITING = "waiting"        # shard actor: cannot be placed yet (cluster full); retried when its lease ends
    SHARDED = "sharded"        # shard actor: manifest committed, copies placed
    REPLICATED = "replicated"  # replicate actors (fan-in decided in the database)
    VERIFIED = "verified"      # verify actor: every replica re-hashed and matched
    ROTATED = "rotated"        # rotate actor: local copy removed, replicas remain
    FAILED = "failed"          # retries exhausted; message in the dead-letter queue
    SUPERSEDED = "superseded"  # catalog, shard, replicate: new content at the path (a newer version)
    VANISHED = "vanished"      # watcher, shard, replicate: the local copy was deleted before it was protected
    FORGOTTEN = "forgotten"    # retention policy, `ckpt forget`: no longer kept remotely, not restorable


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


class ReconcileState(StrEnum):
    QUEUED = "queued"              # scheduler: a worker came back (or a person asked)
    RECONCILING = "reconciling"    # reconcile actor: paging through the worker's inventory from a cursor
    DONE = "done"                  # reconcile actor: every held file matched, quarantined, trimmed or deleted
    FAILED = "failed"              # retries exhausted


class GcState(StrEnum):
    QUEUED = "queued"          # `ckpt gc`, the scheduled collection: one job per storage worker
    COLLECTING = "collecting"  # gc actor: deleting the worker's copies of condemned content, throttled
    DONE = "done"              # gc actor: none left (or the worker is down: it deletes them when it returns)
    FAILED = "failed"          # retries exhausted


class RepairState(StrEnum):
    QUEUED = "queued"          # scrub / reconcile / scheduler: one content short of RF good copies
    REPAIRING = "repairing"    # repair actor: copying from a copy (or local file) that matches its SHA-256
    DONE = "done"              # repair actor: the content is back at RF copies, verified
    LOST = "lost"              # repair actor: no copy and no local file matches the content
    FAILED = "failed"          # retries exhausted


_S, _R, _C, _P, _Q, _G = StoreState, RestoreState, ScrubState, RepairState, ReconcileState, GcState


def _edges(table: dict) -> dict[str, frozenset[str]]:
    # Enum members hash by name, not value: key the tables by plain strings.
    return {str(k.value): frozenset(str(t.value) for t in v) for k, v in table.items()}


TRANSITIONS: dict[str, dict[str, frozenset[str]]] = {
    JobKind.STORE.value: _edges({
        _S.DETECTED: frozenset({_S.SHARDED, _S.WAITING, _S.FAILED, _S.SUPERSEDED, _S.VANISHED}),
        # Placement is retried by the scheduler once the wait's lease ends.
        _S.WAITING: frozenset({_S.DETECTED, _S.SUPERSEDED, _S.VANISHED}),
        # A copy refused for lack of room, with no other worker to take it: the store waits.
        _S.SHARDED: frozenset({_S.REPLICATED, _S.WAITING, _S.FAILED, _S.SUPERSEDED, _S.VANISHED}),
        # A replica found missing, corrupt or unreachable at verify is replaced: back to sharded.
        _S.REPLICATED: frozenset({_S.VERIFIED, _S.SHARDED, _S.FAILED, _S.SUPERSEDED, _S.VANISHED}),
        # New content at the path makes every older version superseded, protected or not;
        # the remote retention policy (or `ckpt forget`) forgets protected ones.
        _S.VERIFIED: frozenset({_S.ROTATED, _S.SUPERSEDED, _S.FORGOTTEN}),
        _S.ROTATED: frozenset({_S.SUPERSEDED, _S.FORGOTTEN}),
        # A failed job can be requeued from the dead-letter queue: it resumes where it was.
        _S.FAILED: frozenset({_S.DETECTED, _S.SHARDED, _S.REPLICATED, _S.VERIFIED, _S.SUPERSEDED, _S.VANISHED}),
        _S.SUPERSEDED: frozenset(),
        _S.VANISHED: frozenset(),
        _S.FORGOTTEN: frozenset(),
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
    JobKind.RECONCILE.value: _edges({
        _Q.QUEUED: frozenset({_Q.RECONCILING, _Q.FAILED}),
        _Q.RECONCILING: frozenset({_Q.DONE, _Q.FAILED}),
        _Q.DONE: frozenset(),
        _Q.FAILED: frozenset({_Q.QUEUED}),
    }),
    JobKind.GC.value: _edges({
        _G.QUEUED: frozenset({_G.COLLECTING, _G.FAILED}),
        _G.COLLECTING: frozenset({_G.DONE, _G.FAILED}),
        _G.DONE: frozenset(),
        _G.FAILED: frozenset({_G.QUEUED}),
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
                           JobKind.SCRUB.value: _C.QUEUED.value, JobKind.REPAIR.value: _P.QUEUED.value,
                           JobKind.RECONCILE.value: _Q.QUEUED.value, JobKind.GC.value: _G.QUEUED.value}

#: States in which nothing more happens without a person (or a new checkpoint) asking.
TERMINAL: dict[str, frozenset[str]] = {
    JobKind.STORE.value: frozenset({_S.ROTATED.value, _S.FAILED.value, _S.SUPERSEDED.value, _S.VANISHED.value,
                                    _S.FORGOTTEN.value}),
    JobKind.RESTORE.value: frozenset({_R.DONE.value, _R.FAILED.value}),
    JobKind.SCRUB.value: frozenset({_C.DONE.value, _C.FAILED.value}),
    JobKind.REPAIR.value: frozenset({_P.DONE.value, _P.LOST.value, _P.FAILED.value}),
    JobKind.RECONCILE.value: frozenset({_Q.DONE.value, _Q.FAILED.value}),
    JobKind.GC.value: frozenset({_G.DONE.value, _G.FAILED.value}),
}

#: States a job can rest in for hours with nobody asking: TERMINAL, and a verified store (it waits
#: for local rotation, which comes only with newer checkpoints). A job page stops following there.
RESTING: dict[str, frozenset[str]] = {
    kind: states | ({_S.VERIFIED.value} if kind == JobKind.STORE.value else frozenset())
    for kind, states in TERMINAL.items()
}

#: States in which an actor is expected to be working, so an expired lease means lost work.
ACTIVE: dict[str, frozenset[str]] = {
    JobKind.STORE.value: frozenset({_S.DETECTED.value, _S.SHARDED.value, _S.REPLICATED.value}),
    JobKind.RESTORE.value: frozenset({_R.QUEUED.value, _R.GATHERING.value, _R.VERIFIED.value}),
    JobKind.SCRUB.value: frozenset({_C.QUEUED.value, _C.SCRUBBING.value}),
    JobKind.REPAIR.value: frozenset({_P.QUEUED.value, _P.REPAIRING.value}),
    JobKind.RECONCILE.value: frozenset({_Q.QUEUED.value, _Q.RECONCILING.value}),
    JobKind.GC.value: frozenset({_G.QUEUED.value, _G.COLLECTING.value}),
}

#: Store states of a checkpoint whose remote copies are complete and verified.
PROTECTED: frozenset[str] = frozenset({_S.VERIFIED.value, _S.ROTATED.value})
#: Store states from which a checkpoint can be given back.
RESTORABLE: frozenset[str] = frozenset({_S.REPLICATED.value, _S.VERIFIED.value, _S.ROTATED.value})
#: Store states in which a checkpoint no longer holds its content (it is garbage once no
#: other checkpoint references it). Entering one sets ``checkpoints.released_at``.
RELEASED: frozenset[str] = frozenset({_S.SUPERSEDED.value, _S.VANISHED.value, _S.FORGOTTEN.value})


def allowed(kind: str, current: str, target: str) -> bool:
    """Tell whether the state machine of ``kind`` has the edge ``current -> target``."""
    return str(target) in TRANSITIONS[str(kind)].get(str(current), frozenset())


def all_states(kind: str) -> frozenset[str]:
    """Every state a job of ``kind`` can be in."""
    return frozenset(TRANSITIONS[str(kind)])


class ContentState(StrEnum):
    """A content object (a row of ``contents``)."""

    LIVE = "live"            # catalog (first referenced), repair and the shard step (reused after collection)
    CONDEMNED = "condemned"  # garbage collection: no kept checkpoint references it; none of its copies counts
    DELETED = "deleted"      # garbage collection: every copy of it is gone from the workers


class CopyState(StrEnum):
    """One content's copy on one storage worker (a row of ``copies``)."""

    PENDING = "pending"      # shard step, repair, verify (a replacement): placed, not stored yet
    STORED = "stored"        # replicate: stored, but its re-hash did not match yet (verify replaces it)
    VERIFIED = "verified"    # replicate, verify, scrub, repair: the worker's re-hash matched the SHA-256
    CORRUPT = "corrupt"      # verify, scrub, repair: the re-hash did not match (quarantined by repair)
    MISSING = "missing"      # scrub, reconcile, repair: the worker does not hold it
    ABANDONED = "abandoned"  # replicate, verify: given up (worker unreachable or full) for a copy elsewhere
    TRIMMED = "trimmed"      # reconcile: a surplus copy, deleted from its worker
    DELETING = "deleting"    # garbage collection: its content is condemned; the worker deletes it


_Rep = CopyState

#: The moves a copy may make: ``COPY_MOVES[from]`` is where it may go, and :func:`pipeline.db.copies.move`
#: (the only code that changes a copy's state) refuses any other. Who makes each move, and why:
COPY_MOVES: dict[CopyState, frozenset[CopyState]] = {
    # replicate: stored (its re-hash is then recorded as a move to verified), or given up
    # (unreachable, full); verify, repair: found corrupt; garbage collection: its content is condemned.
    _Rep.PENDING: frozenset({_Rep.STORED, _Rep.CORRUPT, _Rep.ABANDONED, _Rep.DELETING}),
    # verify: missing (sent again: pending), corrupt, unreachable (abandoned); verify, scrub, reconcile,
    # repair: re-hashed (verified) or damaged; reconcile (surplus), garbage collection: deleting.
    _Rep.STORED: frozenset({_Rep.PENDING, _Rep.VERIFIED, _Rep.CORRUPT, _Rep.MISSING, _Rep.ABANDONED,
                            _Rep.DELETING}),
    # The same; verified -> verified is a re-hash that matched again (recheck, verify, scrub).
    _Rep.VERIFIED: frozenset({_Rep.PENDING, _Rep.VERIFIED, _Rep.CORRUPT, _Rep.MISSING, _Rep.ABANDONED,
                              _Rep.DELETING}),
    # scrub, reconcile: a re-hash that matches again (verified), found again or absent now; repair:
    # rebuilt on the same worker (stored, then verified by its re-hash), or its rebuild failed.
    _Rep.CORRUPT: frozenset({_Rep.STORED, _Rep.VERIFIED, _Rep.CORRUPT, _Rep.MISSING, _Rep.DELETING}),
    _Rep.MISSING: frozenset({_Rep.STORED, _Rep.VERIFIED, _Rep.CORRUPT, _Rep.MISSING, _Rep.DELETING}),
    # placement reuses a retired row for a new copy on the same worker; reconcile, garbage
    # collection: the worker still holds a file for it, deleted now.
    _Rep.ABANDONED: frozenset({_Rep.PENDING, _Rep.DELETING}),
    # No move enters ``trimmed`` any more (a surplus copy goes through ``deleting``); rows an
    # earlier version left are reused like abandoned ones.
    _Rep.TRIMMED: frozenset({_Rep.PENDING, _Rep.DELETING}),
    # Only the deletion removes the row; a repeat (reconcile of a worker the sweep missed) is allowed.
    _Rep.DELETING: frozenset({_Rep.DELETING}),
}


def copy_sources(target: str) -> frozenset[CopyState]:
    """The copy states from which :data:`COPY_MOVES` allows a move to ``target``."""
    return frozenset(s for s, targets in COPY_MOVES.items() if target in targets)


#: Copies the worker should hold a file for: scrub and reconcile check them.
HELD: frozenset[str] = frozenset({_Rep.STORED.value, _Rep.VERIFIED.value, _Rep.CORRUPT.value,
                                  _Rep.MISSING.value})
#: Copies the control plane expects on a worker (reconcile): held ones and those being sent.
EXPECTED: frozenset[str] = HELD | {_Rep.PENDING.value}
#: Copies a restore may read, best first (the file's and each shard's SHA-256 check them).
READABLE_COPIES: tuple[str, ...] = (_Rep.VERIFIED.value, _Rep.STORED.value)
#: Copies that are done being sent.
SENT: frozenset[str] = frozenset({_Rep.STORED.value, _Rep.VERIFIED.value})
#: Copies on their way to RF: sent or being sent (placement counts them).
PLACED: frozenset[str] = SENT | {_Rep.PENDING.value}
#: Copies found damaged.
DAMAGED: frozenset[str] = frozenset({_Rep.CORRUPT.value, _Rep.MISSING.value})
#: Rows that stand for no file the worker should hold: not shown as copies, never counted;
#: placement may put a new copy on that worker again (see REUSABLE).
RETIRED: frozenset[str] = frozenset({_Rep.ABANDONED.value, _Rep.TRIMMED.value, _Rep.DELETING.value})
#: Retired rows placement may reuse for a new copy on the same worker. A ``deleting`` row is
#: not one: its file is being deleted, and only the deletion removes the row.
REUSABLE: frozenset[str] = frozenset({_Rep.ABANDONED.value, _Rep.TRIMMED.value})


class Tier(StrEnum):
    """Where a storage "worker" row keeps its copies (``storage_workers.tier``)."""

    WORKERS = "workers"          # a storage worker daemon (workers/): its copies count toward RF
    OBJECT_STORE = "objectstore"  # an S3-compatible bucket (pipeline/objectstore/): counted by the tier policy


class WorkerState(StrEnum):
    """A storage worker as the control plane sees it (a row of ``storage_workers``)."""

    CANDIDATE = "candidate"  # discovery (mDNS): found, not yet challenged
    UP = "up"                # membership: proved it holds the cluster key and answers
    FULL = "full"            # membership, replicate (a 507): above the high watermark; serves, counts, gets nothing new
    DOWN = "down"            # membership (unseen for worker_down_seconds); replicate, verify (unreachable)
    REJECTED = "rejected"    # membership: failed the cluster-key challenge
    DRAINING = "draining"    # an operator (`ckpt worker drain`): its copies are being moved away
    REMOVABLE = "removable"  # scheduler: drained, every shard it held has RF good copies elsewhere


_W = WorkerState

#: Workers whose copies count toward RF.
COUNTING_WORKERS: frozenset[str] = frozenset({_W.UP.value, _W.FULL.value})
#: Workers placement may choose for a new copy.
PLACEABLE_WORKERS: frozenset[str] = frozenset({_W.UP.value})
#: Workers a copy can be read from (a draining worker still serves its copies).
READABLE_WORKERS: frozenset[str] = frozenset({_W.UP.value, _W.FULL.value, _W.DRAINING.value})
#: Workers a scrub re-hashes.
SCRUBBED_WORKERS: frozenset[str] = READABLE_WORKERS
#: States an operator decided: a probe does not override them (:data:`WORKER_MOVES` has no
#: edge from them to ``up``, ``full``, ``down`` or ``rejected``).
STICKY_WORKERS: frozenset[str] = frozenset({_W.DRAINING.value, _W.REMOVABLE.value})

#: The state a worker row is created in: discovery and membership record what they found;
#: only a proof of the cluster key admits it.
WORKER_INITIAL = _W.CANDIDATE

#: The moves a worker may make: ``WORKER_MOVES[from]`` is where it may go, and
#: :func:`pipeline.db.workers.set_state` (the only code that changes a worker's state) refuses any
#: other. A repeat (``up -> up`` at every probe) is no move. Who makes each:
#: membership admits (``up``, ``full``), rejects, or finds a worker silent or replaced at its URL
#: (``down``); replicate and verify find one unreachable (``down``) or full (a 507); an operator
#: drains one (``ckpt worker drain``), and the scheduler marks it ``removable`` once drained.
#: The sticky rule is this table: from ``draining`` only the scheduler's ``removable`` (drained)
#: leads anywhere, and nothing leaves ``removable``. A failed cluster-key challenge there (a
#: stranger answering at its URL, maybe once) is recorded as its error, never as a state that
#: the next good probe would turn into ``up``, cancelling the drain.
WORKER_MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    _W.CANDIDATE: frozenset({_W.UP, _W.FULL, _W.DOWN, _W.REJECTED, _W.DRAINING}),
    _W.UP: frozenset({_W.FULL, _W.DOWN, _W.REJECTED, _W.DRAINING}),
    _W.FULL: frozenset({_W.UP, _W.DOWN, _W.REJECTED, _W.DRAINING}),
    _W.DOWN: frozenset({_W.UP, _W.FULL, _W.REJECTED, _W.DRAINING}),
    # A rejected worker proves the key again (admitted), or replicate and verify find it unreachable.
    _W.REJECTED: frozenset({_W.UP, _W.FULL, _W.DOWN, _W.DRAINING}),
    _W.DRAINING: frozenset({_W.REMOVABLE}),
    _W.REMOVABLE: frozenset(),
}


#: The operator's undrain (``ckpt workers undrain``), the one way out of ``draining`` and
#: ``removable``: back to ``down``, never straight to a state whose copies count. The next good
#: probe then brings it back like any worker that returns (reconciled before its copies count
#: again, its surplus trimmed). Only :func:`pipeline.db.workers.set_state` with ``operator=True``
#: takes these edges; a probe or a request (``observe``) never does, so the sticky rule holds.
UNDRAIN_MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    _W.DRAINING: frozenset({_W.DOWN}),
    _W.REMOVABLE: frozenset({_W.DOWN}),
}


def worker_may(current: str, target: str) -> bool:
    """Whether :data:`WORKER_MOVES` lets a worker in ``current`` be set to ``target`` (a repeat may)."""
    return current == target or target in WORKER_MOVES[WorkerState(current)]
