"""What the chaos soak checks, from the disks and not from what the database believes.

- :class:`DiskIndex`: which storage workers hold a copy of a content, by reading each worker's
  own disk (``shards/ab/cd/<sha256>``) and hashing the file.
- :class:`Guard`: watches the training hosts' runs; the moment a saved checkpoint disappears
  from its run (rotation renames it to its trash first: that rename is the decision), it counts
  the good copies of every shard on the workers' disks. Fewer than RF is an unsafe deletion.
- :func:`protection`: at the end, every save the trainers completed (their ledger) is still
  whole on its host's disk, or each of its shards has RF good copies on distinct workers' disks.
- The object store, asked directly (bench/chaos/bucket.py): a save of the ``required`` run leaves
  its host only once the bucket holds each of its shards (:class:`Guard`), and after the heal
  every protected save of either run has all its shards there (:func:`off_bucket`); no copy on
  the store was given up or found bad because the store was down (:func:`store_copy_states`).
- :func:`stuck_jobs`, :func:`workers_not_up`, :func:`redis_sample`: jobs with no sign of life
  for lease x 3, workers the control plane does not count, Redis memory and queue depths.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import func, select

from bench.chaos.box import STORAGE, TRAINERS, ChaosBox
from bench.chaos.bucket import REQUIRED_RUN, SoakBucket
from bench.chaos.trainer import sha256_of
from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, ContentCopy, Job, JobEvent, Shard, StorageWorker


@dataclass(frozen=True)
class Save:
    """One save a trainer completed (a line of its ledger)."""

    host: str
    step: int
    path: str
    files: dict[str, str]  # relpath ("" for a single file) -> SHA-256 of what was written
    bytes: int
    at: float

    def local(self, rel: str) -> Path:
        return Path(self.path) / rel if rel else Path(self.path)

    @property
    def required(self) -> bool:
        """Whether its run's object-store copies are ``required`` before a local deletion."""
        return Path(self.path).parent.name == REQUIRED_RUN


def read_ledgers(box: ChaosBox) -> list[Save]:
    out = []
    for h in TRAINERS:
        p = box.ledger(h)
        if p.exists():
            for line in p.read_text().splitlines():
                if line.strip():
                    d = json.loads(line)
                    out.append(Save(d["host"], d["step"], d["path"], d["files"], d["bytes"], d["at"]))
    return out


class DiskIndex:
    """Good copies on the workers' disks. With ``cache``, a file is hashed again only when its
    inode, size or mtime changed (shard files are written once, under a temporary name)."""

    def __init__(self, box: ChaosBox, cache: bool = True) -> None:
        self.box, self.cache = box, cache
        self._hashed: dict[tuple[str, int, int, int], str] = {}

    def holders(self, sha: str) -> set[str]:
        out = set()
        for w in STORAGE:
            p = self.box.data(w) / "shards" / sha[:2] / sha[2:4] / sha
            try:
                st = p.stat()
            except OSError:
                continue
            key = (str(p), st.st_ino, st.st_size, st.st_mtime_ns)
            digest = self._hashed.get(key) if self.cache else None
            if digest is None:
                try:
                    digest = sha256_of(p)
                except OSError:
                    continue
                if self.cache:
                    self._hashed[key] = digest
            if digest == sha:
                out.add(w)
        return out


@dataclass
class Manifest:
    checkpoint_id: int | None
    store_state: str | None
    shards: dict[str, list[str]] = field(default_factory=dict)  # relpath -> shard SHA-256s
    sizes: dict[str, int] = field(default_factory=dict)  # relpath -> bytes
    problem: str = ""

    def all_shards(self) -> list[str]:
        return sorted({sha for shas in self.shards.values() for sha in shas})


def manifest(db_url: str, save: Save) -> Manifest:
    """The recorded checkpoint whose files are the bytes ``save`` wrote, and its shards."""
    with session_scope(db_url, readonly=True) as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.path == save.path, Checkpoint.host == save.host)
                         .order_by(Checkpoint.id.desc())).all()
        for c in rows:
            files = s.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == c.id)).all()
            if {f.relpath: f.sha256 for f in files} != save.files:
                continue
            job = s.scalars(select(Job).where(Job.checkpoint_id == c.id, Job.kind == "store")
                            .order_by(Job.id.desc()).limit(1)).first()
            m = Manifest(c.id, job.state if job else None)
            for f in files:
                m.sizes[f.relpath] = f.size
                m.shards[f.relpath] = list(s.scalars(select(Shard.sha256).where(Shard.file_id == f.id)
                                                      .order_by(Shard.seq)))
            return m
        seen = ", ".join(f"#{c.id} ({len(c.files)} files)" for c in rows) or "none"
        return Manifest(None, None, problem=f"no recorded checkpoint holds these bytes (rows at this path: {seen})")


def short_copies(m: Manifest, index: DiskIndex, rf: int) -> tuple[list[str], set[str]]:
    """Shards with fewer than ``rf`` good copies on distinct workers' disks (described), and the
    relpaths of files with a shard that has none at all."""
    problems, lost = [], set()
    for rel, shas in m.shards.items():
        if not shas:
            problems.append(f"{rel or '(file)'}: no shards recorded")
        for seq, sha in enumerate(shas):
            n = len(index.holders(sha))
            if n < rf:
                problems.append(f"{rel or '(file)'} shard {seq} {sha[:12]}: {n}/{rf} good copies on disk")
            if n == 0:
                lost.add(rel)
    return problems, lost


@dataclass
class Deletion:
    host: str
    path: str
    at: float
    ok: bool
    detail: str
    faults: str  # the faults active or healed shortly before


class Guard:
    """Watches the runs of every training host; checks each disappearance at once."""

    def __init__(self, box: ChaosBox, rf: int, context: Callable[[], str], every: float = 0.25) -> None:
        self.box, self.rf, self.context, self.every = box, rf, context, every
        self.bucket: SoakBucket = box.bucket
        self.index = DiskIndex(box)
        self.deletions: list[Deletion] = []
        self._present: dict[str, str] = {}  # path -> host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-guard", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> Guard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _scan(self) -> dict[str, str]:
        out = {}
        for h in TRAINERS:
            for run in ("sft", "hf"):
                d = self.box.runs(h) / run
                try:
                    names = [e.name for e in d.iterdir()]
                except OSError:
                    continue
                for name in names:
                    if not name.startswith(".") and not name.endswith(".tmp"):
                        out[str(d / name)] = h
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self._scan()
            gone = [(p, h) for p, h in self._present.items() if p not in now]
            self._present = now
            if gone:
                saves = {(s.host, s.path): s for s in read_ledgers(self.box)}
                for path, host in gone:
                    try:
                        self.deletions.append(self.judge(host, path, saves.get((host, path))))
                    except Exception as e:  # the check itself must not stop watching
                        self.errors.append(f"{path}: {type(e).__name__}: {e}")
            self._stop.wait(self.every)

    def judge(self, host: str, path: str, save: Save | None) -> Deletion:
        at = time.time()
        if save is None:
            return Deletion(host, path, at, False, "deleted before its save was complete (not in the ledger)",
                            self.context())
        m = manifest(self.box.db_url, save)
        if m.checkpoint_id is None:
            return Deletion(host, path, at, False, m.problem, self.context())
        problems, _ = short_copies(m, self.index, self.rf)
        if save.required:  # the bucket's own word, asked now (HeadObject: a listing may lag a put)
            problems += [f"object store: {sha[:12]}: {why}" for sha in m.all_shards()
                         if (why := self.bucket.proof(sha))]
        detail = f"checkpoint {m.checkpoint_id}, store {m.store_state}"
        if problems:
            detail += ": " + "; ".join(problems[:4]) + (f" (+{len(problems) - 4})" if len(problems) > 4 else "")
        return Deletion(host, path, at, not problems, detail, self.context())


@dataclass
class SaveVerdict:
    save: Save
    outcome: str  # protected | local | UNPROTECTED | LOST
    detail: str = ""
    lost_bytes: int = 0
    store_state: str | None = None
    shards: list[str] = field(default_factory=list)


def protection(box: ChaosBox, saves: list[Save], rf: int) -> list[SaveVerdict]:
    """Each save: whole on its host's disk, or RF good copies of each shard (files re-read now)."""
    index = DiskIndex(box, cache=False)
    out = []
    for save in saves:
        local = all(save.local(rel).is_file() and sha256_of(save.local(rel)) == sha for rel, sha in save.files.items())
        m = manifest(box.db_url, save)
        if m.checkpoint_id is None:
            out.append(SaveVerdict(save, "local" if local else "LOST", m.problem,
                                   0 if local else save.bytes))
            continue
        problems, lost = short_copies(m, index, rf)
        if not problems:
            out.append(SaveVerdict(save, "protected", f"checkpoint {m.checkpoint_id}, store {m.store_state}",
                                   store_state=m.store_state, shards=m.all_shards()))
        elif local:
            bad = m.store_state in (states.StoreState.FAILED,)
            out.append(SaveVerdict(save, "GIVEN UP" if bad else "local",
                                   f"checkpoint {m.checkpoint_id}, store {m.store_state}: {problems[0]}",
                                   store_state=m.store_state))
        else:
            lost_bytes = sum(m.sizes.get(rel, 0) for rel in lost
                             if not (save.local(rel).is_file() and sha256_of(save.local(rel)) == save.files[rel]))
            out.append(SaveVerdict(save, "LOST" if lost else "UNPROTECTED",
                                   f"checkpoint {m.checkpoint_id}, store {m.store_state}: " + "; ".join(problems[:4]),
                                   lost_bytes, m.store_state))
    return out


def off_bucket(bucket: SoakBucket, verdicts: list[SaveVerdict]) -> tuple[list[str], int]:
    """Protected saves (verified or rotated) whose shards the bucket does not hold (listed, and
    proven by HeadObject), described; and how many shards were proven there."""
    listed = bucket.listing()
    out, proven = [], 0
    for v in verdicts:
        if v.store_state not in states.PROTECTED:
            continue
        missing = bucket.missing(v.shards, listed)
        proven += len(v.shards) - len(missing)
        if missing:
            what = "required run" if v.save.required else "lagging copies never landed"
            out.append(f"save {v.save.path} ({v.save.host}, {v.detail}): {what}: {len(missing)}/{len(v.shards)} "
                       f"shards not on the object store: " + "; ".join(missing[:3]))
    return out, proven


def store_copy_states(db_url: str) -> dict[str, int]:
    """The object-store tier's copy rows by state (the control plane's view, for the table and
    for copies it gave up or found bad)."""
    with session_scope(db_url, readonly=True) as s:
        rows = s.execute(select(ContentCopy.state, func.count())
                         .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
                         .where(StorageWorker.tier == "objectstore").group_by(ContentCopy.state)).all()
    return {state: n for state, n in rows}


def failed_stores(db_url: str) -> list[str]:
    """Store jobs that ended ``failed`` (the pipeline gave up protecting a save), with why."""
    with session_scope(db_url, readonly=True) as s:
        rows = s.execute(select(Job.id, Checkpoint.host, Checkpoint.path, Job.attempts, Job.last_error)
                         .join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
                         .where(Job.kind == "store", Job.state == states.StoreState.FAILED.value)).all()
    return [f"store job {i} of {path} ({host}) failed after {n} attempts: {(err or '')[:240]}"
            for i, host, path, n, err in rows]


def _job_alive_at(job: Job, last_event: datetime | None, lease: float) -> float:
    """When the job last showed life: an update, a timeline entry, or a lease renewal."""
    marks = [job.updated_at.timestamp()]
    if last_event is not None:
        marks.append(last_event.timestamp())
    if job.lease_until is not None:
        marks.append(job.lease_until.timestamp() - lease)
    return max(marks)


def stuck_jobs(db_url: str, lease: float, now: float | None = None) -> list[str]:
    """Jobs in a working (or waiting) state with no sign of life for lease x 3."""
    now = now or time.time()
    out = []
    working = {k: set(v) for k, v in states.ACTIVE.items()}
    working[states.JobKind.STORE.value].add(states.StoreState.WAITING.value)
    with session_scope(db_url, readonly=True) as s:
        for job in s.scalars(select(Job)):
            if job.state not in working.get(job.kind, ()):
                continue
            last = s.scalar(select(func.max(JobEvent.at)).where(JobEvent.job_id == job.id))
            idle = now - _job_alive_at(job, last, lease)
            if idle > 3 * lease:
                out.append(f"job {job.id} {job.kind} {job.state} for {idle:.0f} s (attempts {job.attempts}, "
                           f"blocked {job.blocked_reason!r}, last error {(job.last_error or '')[:160]!r})")
    return out


def active_jobs(db_url: str) -> int:
    """Jobs in a state where an actor is expected to be working."""
    with session_scope(db_url, readonly=True) as s:
        return sum(s.scalar(select(func.count()).select_from(Job).where(Job.kind == k, Job.state.in_(v))) or 0
                   for k, v in states.ACTIVE.items())


def stores_in_flight(db_url: str) -> dict[int, str | None]:
    """Store jobs not yet verified (working, or waiting for room): job id -> its checkpoint's host."""
    with session_scope(db_url, readonly=True) as s:
        rows = s.execute(select(Job.id, Checkpoint.host).join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
                         .where(Job.kind == "store", Job.state.in_(states.ACTIVE["store"] | {"waiting"}))).all()
    return {job_id: host for job_id, host in rows}


def active_work(db_url: str) -> int:
    """Job steps that may have a message outstanding: working jobs and copies not yet stored."""
    jobs = active_jobs(db_url)
    with session_scope(db_url, readonly=True) as s:
        pending = s.scalar(select(func.count()).select_from(ContentCopy)
                           .where(ContentCopy.state == states.CopyState.PENDING.value)) or 0
    return jobs + pending


def workers_not_up(db_url: str, urls: dict[str, str]) -> dict[str, str]:
    """The storage hosts whose worker the control plane does not hold ``up``: host -> state."""
    with session_scope(db_url, readonly=True) as s:
        rows = {w.url: (w.state, w.last_error) for w in s.scalars(select(StorageWorker))}
    out = {}
    for host, url in urls.items():
        state, err = rows.get(url, ("absent", None))
        if state != states.WorkerState.UP:
            out[host] = f"{state} ({(err or '')[:160]})"
    return out


def consumed_since(db_url: str, host: str, since: datetime) -> bool:
    """Whether a Dramatiq worker of training host ``host`` said it consumes the host's queue
    after ``since`` (a restore is routed there only then: pipeline/db/hosts.py)."""
    from pipeline.db import hosts

    with session_scope(db_url, readonly=True) as s:
        seen = hosts.consumer_seen(s, host)
    return seen is not None and seen > since


def store_states(db_url: str) -> dict[str, int]:
    with session_scope(db_url, readonly=True) as s:
        rows = s.execute(select(Job.kind, Job.state, func.count()).group_by(Job.kind, Job.state)).all()
    return {f"{k} {st}": n for k, st, n in rows}


def redis_sample(socket: Path) -> dict[str, int] | None:
    """Redis's memory and the depth of each Dramatiq queue (ready, delayed, dead), or None
    while Redis is down."""
    import redis

    try:
        r = redis.Redis(unix_socket_path=str(socket), socket_timeout=2)
        out = {"used_memory": int(r.info("memory")["used_memory"])}
        for key in r.scan_iter("dramatiq:*"):
            name = key.decode()
            kind = r.type(key).decode()
            if kind == "list":
                out[name] = r.llen(key)
            elif kind == "zset":
                out[name] = r.zcard(key)
        r.close()
        return out
    except (redis.RedisError, OSError):
        return None


def now_utc() -> datetime:
    return datetime.now(UTC)
