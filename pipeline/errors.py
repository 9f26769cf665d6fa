"""The one exception tree of ckpt-pipeline.

Every error a user can see derives from :class:`CkptError`, carries its data as
attributes and says what to do about it.
"""
from __future__ import annotations

from datetime import datetime


class CkptError(Exception):
    """Raised for any failure ckpt-pipeline reports to a user."""


class ConfigError(CkptError):
    """Raised when a setting is missing or has a value that cannot work."""


class HeaderError(CkptError):
    """Raised when a safetensors file's header is malformed or lies about its data.

    ``truncated`` says the file is only shorter than its header needs (it may still be
    being written); otherwise no more writing can make it valid.
    """

    def __init__(self, path: str, reason: str, *, truncated: bool = False) -> None:
        self.path = path
        self.reason = reason
        self.truncated = truncated
        super().__init__(f"{path}: invalid safetensors file: {reason}")


class IncompleteCheckpoint(CkptError):
    """Raised when a checkpoint is not (yet) structurally complete."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: checkpoint is not complete: {reason}")


class UnreadableEntry(CkptError):
    """Raised when an entry of a run can never be read as a checkpoint as it is (a name that is
    not UTF-8, a tree nested too deep): the watcher reports it once and goes on with the rest."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: not a checkpoint: {reason}")


class OutsideRoots(CkptError):
    """Raised when a path to protect is not inside any watched root."""

    def __init__(self, path: str, roots: list[str]) -> None:
        self.path = path
        self.roots = roots
        shown = ", ".join(roots) or "(none configured: pass --root or set CKPT_ROOTS)"
        super().__init__(f"{path} is not a checkpoint inside a watched root; roots: {shown}")


class NotProtectedYet(CkptError):
    """Raised when a wait for a checkpoint's protection ran out of time; its store goes on."""


class UnknownCheckpoint(CkptError):
    """Raised when a checkpoint id or path names nothing in the control plane."""

    def __init__(self, ref: str) -> None:
        self.ref = ref
        super().__init__(f"no checkpoint {ref!r}; `ckpt status` lists the known ones")


class UnknownJob(CkptError):
    """Raised when a job id names nothing in the control plane."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"no job {job_id}")


class UnknownRun(CkptError):
    """Raised when a run names no checkpoint in the control plane."""

    def __init__(self, run: str) -> None:
        self.run = run
        super().__init__(f"no run {run!r}: no checkpoint was recorded under it; `ckpt status` lists the runs")


class InvalidTransition(CkptError):
    """Raised when a job is asked to move along an edge the state machine does not have."""

    def __init__(self, kind: str, job_id: int, current: str, target: str) -> None:
        self.kind, self.job_id, self.current, self.target = kind, job_id, current, target
        super().__init__(f"{kind} job {job_id}: cannot go from {current!r} to {target!r}")


class InvalidMove(CkptError):
    """Raised when a copy or a storage worker is asked to make a move its table does not have
    (pipeline.states.COPY_MOVES, WORKER_MOVES)."""

    def __init__(self, what: str, current: str, target: str) -> None:
        self.what, self.current, self.target = what, str(current), str(target)
        super().__init__(f"{what}: cannot go from {self.current!r} to {self.target!r}")


class PlacementError(CkptError):
    """Raised when there are not enough live storage workers for the replication factor."""

    def __init__(self, needed: int, live: int) -> None:
        self.needed, self.live = needed, live
        super().__init__(
            f"need {needed} distinct live storage workers, have {live}; "
            "start more (`ckpt worker`) or lower CKPT_RF"
        )


class WorkerError(CkptError):
    """Raised when a storage worker cannot be reached or answers with an error."""

    def __init__(self, worker: str, reason: str, status: int | None = None) -> None:
        self.worker, self.reason, self.status = worker, reason, status
        super().__init__(f"storage worker {worker}: {reason}")


class UntrustedAnswer(WorkerError):
    """Raised when an answer was not signed with the cluster key by the worker asked: treated
    like no answer (nothing is decided on it), and at admission as a failed challenge."""


class HashMismatch(CkptError):
    """Raised when bytes do not hash to the SHA-256 the manifest records."""

    def __init__(self, what: str, expected: str, actual: str) -> None:
        self.what, self.expected, self.actual = what, expected, actual
        super().__init__(f"{what}: SHA-256 {actual[:16]}... does not match manifest {expected[:16]}...")


class SourceChanged(CkptError):
    """Raised when a checkpoint's files changed after they were detected."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path} changed after detection ({reason}); the job is superseded")


class RestoreError(CkptError):
    """Raised when a checkpoint cannot be given back (no healthy replica, bad destination)."""


class UnsafeDestination(RestoreError):
    """Raised when a restore may not write where it was asked to (outside the restore roots, an
    overwrite of something that is not a protected checkpoint's content, a staging path
    tampered with); the restore job fails at once, it is not retried."""


class StoreUnavailable(RestoreError):
    """Raised when the only copies of a shard a restore could still read are on an object store
    that cannot serve them now (throttling, unreachable, credentials, a missing bucket: an
    :class:`ObjectStoreError` that waits); the restore job fails at once, nothing is put at
    its destination, and the message names the store and what to do."""

    def __init__(self, what: str, url: str, cause: ObjectStoreError, tried: list[str]) -> None:
        self.url, self.cause, self.tried = url, cause, tried
        workers = (f" (every storage worker copy failed: {'; '.join(tried)})" if tried
                   else " (no storage worker holds it)")
        super().__init__(f"{what}: its last copy is on object store {url}, which cannot serve it now{workers}: "
                         f"{cause}. Nothing was written at the destination; restore again once the store answers")


class DestinationExists(RestoreError):
    """Raised when a restore's destination already exists and overwriting was not asked for."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        super().__init__(f"{dest} already exists; choose another destination or pass --overwrite")


class NoConsumer(RestoreError):
    """Raised when a restore is asked for a host whose queue no Dramatiq process consumes now
    (it would wait there for ever): refused at once, nothing is recorded."""

    def __init__(self, host: str, seen: datetime | None, live: list[str]) -> None:
        self.host, self.seen, self.live = host, seen, live
        when = f"last seen {seen.isoformat(timespec='seconds')}" if seen else "never seen"
        where = (f"hosts with a running consumer: {', '.join(live)}" if live
                 else "no host has a running consumer: start `ckpt up` or `dramatiq pipeline.tasks` on the host")
        super().__init__(f"no Dramatiq worker consumes host {host}'s queue ({when}), so a restore there would never "
                         f"run; start `dramatiq pipeline.tasks` on {host} or pick another host ({where})")


class AttemptsExhausted(CkptError):
    """Raised when a step has run ``max_attempts`` times without finishing; never retried."""

    def __init__(self, what: str, attempts: int, last_error: str | None) -> None:
        self.what, self.attempts, self.last_error = what, attempts, last_error
        super().__init__(f"{what}: gave up after {attempts} attempts; last error: {last_error or 'none recorded'}")


class ShardRefused(CkptError):
    """Raised by a storage worker that refuses a request; ``status`` is the HTTP status it answers.

    400 a malformed request, 401 a body other than the signed one, 411 no length, 413 too
    large, 422 bytes that do not hash to the shard's name, 507 no space left.
    """

    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason
        super().__init__(reason)


class MalformedStream(ShardRefused):
    """Raised when a compressed shard stream is malformed, ends early or holds more than its
    declared length (pipeline/cluster/wire.py): the sender's error, like bytes that do not match."""

    def __init__(self, reason: str) -> None:
        super().__init__(400, reason)


class CorruptFrame(MalformedStream):
    """Raised when a frame of the planes codec (pipeline/codec/frames.py) is truncated,
    corrupted or not a frame at all: nothing is decoded from it, never wrong bytes."""


class AuthError(CkptError):
    """Raised when a request does not carry a valid cluster-key signature."""


class MissingRow(CkptError):
    """Raised when a row that a step relies on is gone from the control plane (deleted under it)."""

    def __init__(self, table: str, key: object) -> None:
        self.table, self.key = table, key
        super().__init__(f"no {table} row {key!r} in the control plane; was it deleted while a step ran?")


class RefusedRecord(CkptError):
    """The control plane refused to record one checkpoint of a batch (its savepoint rolled back,
    the others recorded): that checkpoint's fault, reported against it, not the control plane's."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"the control plane refused to record it: {type(exc).__name__}: {exc}")


class ObjectStoreError(CkptError):
    """Raised when an object-store target (``[[targets]]``, pipeline/objectstore) cannot do what
    was asked. ``wait`` says what a job does with it: wait and try again later, nothing marked
    lost (the store is throttling, down, unreachable, or needs its operator: credentials, a
    bucket), or not (this object is bad or absent: the copy does not count and is repaired)."""

    wait = True

    def __init__(self, target: str, reason: str) -> None:
        self.target, self.reason = target, reason
        super().__init__(f"object store {target}: {reason}")


class StoreThrottled(ObjectStoreError):
    """The store kept answering 503 SlowDown (or another throttling code) through every retry
    with backoff."""


class StoreServerError(ObjectStoreError):
    """The store kept answering 5xx (500 InternalError, 502, 504) through every retry."""


class StoreUnreachable(ObjectStoreError):
    """The endpoint could not be reached: connection refused, a timeout, a connection cut."""


class StoreCredentials(ObjectStoreError):
    """The store refused the credentials (wrong, expired, missing, a profile that does not exist,
    or a key without the permission asked for); the message names where they came from."""


class BucketMissing(ObjectStoreError):
    """The target's bucket does not exist (or was deleted)."""


class ObjectMissing(ObjectStoreError):
    """The object a copy names is not in the store."""

    wait = False


class ObjectMismatch(ObjectStoreError):
    """The store holds other bytes than the name says (tampered, truncated, a checksum that does
    not match or is absent), or refused an upload whose bytes did not match their checksum."""

    wait = False
