"""How full the cluster is, who uses it, and when it fills up.

The scheduler samples the workers' usage (their own reports, from the probes) every
:data:`SAMPLE_SECONDS`; "days until full" extrapolates the growth of the last
:data:`RATE_WINDOW` to the high watermark. Per run, the stored bytes of the content its kept
checkpoints reference are split into unique (no other run references it) and shared.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db.copies import live_candidates
from pipeline.db.models import (
    CapacitySample,
    Checkpoint,
    CheckpointFile,
    Content,
    ContentCopy,
    Shard,
    StorageWorker,
)
from pipeline.db.transitions import now
from pipeline.settings import Settings
from pipeline.states import COUNTING_WORKERS, DAMAGED, PLACED, ContentState
from pipeline.units import human_bytes

SAMPLE_SECONDS = 600.0
RATE_WINDOW = timedelta(days=3)
#: The least history a forecast is made from: a rate from a few minutes of a first store says
#: "full in 0.1 days" of a cluster that fills up in years.
MIN_HISTORY = timedelta(hours=1)
KEEP_SAMPLES = timedelta(days=400)


def days_until_full(samples: Sequence[tuple[datetime, int]], limit: int) -> float | None:
    """Days until ``used`` reaches ``limit`` at the rate of ``samples`` ``(at, used)`` (least
    squares over the window); None when the usage is not growing or the samples span less than
    :data:`MIN_HISTORY`."""
    if len(samples) < 2 or limit <= 0 or samples[-1][0] - samples[0][0] < MIN_HISTORY:
        return None
    t0 = samples[0][0]
    xs = [(at - t0).total_seconds() / 86400 for at, _u in samples]
    ys = [float(u) for _at, u in samples]
    if xs[-1] - xs[0] <= 0:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    per_day = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    if per_day <= 0:
        return None
    return max(0.0, (limit - ys[-1]) / per_day)


@dataclass(frozen=True)
class Usage:
    used: int            # what the workers report their shards use
    capacity: int
    free: int
    stored: int          # content size x sent copies, as the control plane knows it
    garbage: int         # stored bytes of condemned content (freed by the running collections)
    workers: int
    #: Filesystems those workers are on: each counted once (:func:`filesystems`).
    filesystems: int
    full_workers: int
    days_until_full: float | None
    #: The forecast in words: when it fills at the recent rate, or why there is none.
    forecast: str
    limit: int           # the high watermark, in bytes

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def stored_bytes(session: Session) -> tuple[int, int]:
    """(all, condemned) bytes of sent copies."""
    sent = ContentCopy.state.in_(sorted(states.SENT))
    # Every sent copy's own size, from the (worker, state, size) index; then the condemned
    # contents' (few: the state index), each with its copies.
    total = session.scalar(select(func.coalesce(func.sum(ContentCopy.size), 0)).where(sent)) or 0
    condemned = session.scalar(select(func.coalesce(func.sum(ContentCopy.size), 0))
                               .join(Content, Content.sha256 == ContentCopy.sha256)
                               .where(Content.state == ContentState.CONDEMNED, sent)) or 0
    return int(total), int(condemned)


@dataclass(frozen=True)
class Filesystem:
    """One filesystem the workers are on, counted once however many workers share it."""

    capacity: int
    free: int
    used: int        # what the workers on it report their shards use
    workers: tuple[str, ...]
    #: The identity its workers report (``worker:<id>`` for one that does not say).
    id: str = ""

    @property
    def used_ratio(self) -> float:
        """1 - free / capacity (0 for a disk whose size is unknown)."""
        return 1 - self.free / self.capacity if self.capacity > 0 else 0.0


def filesystems(workers: Sequence[StorageWorker]) -> list[Filesystem]:
    """The filesystems ``workers`` are on, by the identity each reports (a worker that does not
    say is a filesystem of its own). Three workers on one 270 GB disk (`ckpt up`) are 270 GB, not
    811: the capacity of a filesystem is its size, or the sum of the shares its workers were
    given (``ckpt worker --capacity``) when smaller; its free bytes likewise; its used bytes the
    sum of each worker's shards (each holds its own files)."""
    groups: dict[str, list[StorageWorker]] = {}
    for w in workers:
        groups.setdefault(w.filesystem or f"worker:{w.id}", []).append(w)
    out = []
    for key, members in groups.items():
        capacity, free = sum(w.capacity_bytes for w in members), sum(w.free_bytes for w in members)
        fs = [w for w in members if w.fs_capacity_bytes is not None]
        if fs:
            capacity = min(capacity, max(w.fs_capacity_bytes or 0 for w in fs))
            free = min(free, min(w.fs_free_bytes or 0 for w in fs))
        out.append(Filesystem(capacity=capacity, free=free, used=sum(w.used_bytes for w in members),
                              workers=tuple(sorted(w.id for w in members)), id=key))
    return out


def readable_disks(session: Session) -> list[Filesystem]:
    """The filesystems of the readable workers that report their capacity, each once (what the
    disk alert, pipeline/alerts.py, and ``ckpt_filesystem_used_ratio`` read), by their workers."""
    workers = session.scalars(select(StorageWorker).where(
        StorageWorker.state.in_(sorted(states.READABLE_WORKERS)), StorageWorker.capacity_bytes > 0)).all()
    return sorted(filesystems(workers), key=lambda f: f.workers)


def usage(session: Session, settings: Settings) -> Usage:
    workers = list(session.scalars(select(StorageWorker).where(  # the workers' tier: object stores have quotas
        StorageWorker.state.in_(sorted(states.READABLE_WORKERS)), StorageWorker.tier == states.Tier.WORKERS)))
    disks = filesystems(workers)
    capacity = sum(d.capacity for d in disks)
    used = sum(d.used for d in disks)
    stored, garbage = stored_bytes(session)
    limit = int(sum(d.capacity * settings.high_watermark - max(0, d.capacity - d.free - d.used)
                    for d in disks))  # the watermark minus what others keep on the same disks
    since = now() - RATE_WINDOW
    samples = [(at, u) for at, u in session.execute(
        select(CapacitySample.at, CapacitySample.used_bytes).where(CapacitySample.at >= since)
        .order_by(CapacitySample.at))]
    if samples:
        samples.append((now(), used))
    return Usage(used=used, capacity=capacity, free=sum(d.free for d in disks), stored=stored,
                 garbage=garbage, workers=len(workers), filesystems=len(disks),
                 full_workers=sum(1 for w in workers if w.state == states.WorkerState.FULL),
                 days_until_full=(days := days_until_full(samples, limit)), limit=limit,
                 forecast=forecast(samples, days))


def forecast(samples: Sequence[tuple[datetime, int]], days: float | None) -> str:
    if days is not None:
        return f"full in {days:,.1f} days at the recent rate"
    if len(samples) < 2 or samples[-1][0] - samples[0][0] < MIN_HISTORY:
        return "too little history to forecast yet (an hour of samples)"
    return "not filling up"


def sample(session: Session, settings: Settings) -> bool:
    """Record the cluster's usage if the last sample is older than :data:`SAMPLE_SECONDS`."""
    t = now()
    last = session.scalar(select(func.max(CapacitySample.at)))
    if last is not None and (t - last).total_seconds() < SAMPLE_SECONDS:
        return False
    u = usage(session, settings)
    session.add(CapacitySample(at=t, used_bytes=u.used, capacity_bytes=u.capacity, stored_bytes=u.stored))
    session.execute(delete(CapacitySample).where(CapacitySample.at < t - KEEP_SAMPLES))
    return True


def history(session: Session, limit: int = 2000) -> list[dict[str, Any]]:
    """The samples, oldest first (at most ``limit``, evenly thinned: every ``step``-th from the
    first). Thinned in SQL: a year of samples is 8,760 rows, and reading each into Python (its
    time decoded) cost more than the rest of the overview's capacity."""
    step = max(1, (session.scalar(select(func.count(CapacitySample.id))) or 0) // limit)
    order = (CapacitySample.at, CapacitySample.id)
    numbered = select(CapacitySample.at, CapacitySample.used_bytes, CapacitySample.stored_bytes,
                      CapacitySample.capacity_bytes,
                      (func.row_number().over(order_by=order) - 1).label("i")).subquery()
    rows = session.execute(select(numbered.c.at, numbered.c.used_bytes, numbered.c.stored_bytes,
                                  numbered.c.capacity_bytes).where(numbered.c.i % step == 0).order_by(numbered.c.i))
    return [{"at": at, "used": u, "stored": st, "capacity": cap} for at, u, st, cap in rows]


def per_run(session: Session, runs: list[str] | None = None) -> dict[str, dict[str, int]]:
    """Per run (``runs`` only, if given), stored bytes of the content its kept checkpoints
    reference: ``unique`` (only this run references it) and ``shared`` (other runs do too).

    One pass over the kept checkpoints' distinct (run, content) pairs, each content's sent copies
    summed along its own index entries; whether a content is shared is counted here from the
    same rows. (Grouping every copy row by content first, then joining, took 60-100 ms at 100k
    checkpoints, most of a page's queries.)"""
    refs = (select(Checkpoint.run.label("run"), Shard.sha256.label("sha"))
            .join(CheckpointFile, CheckpointFile.checkpoint_id == Checkpoint.id)
            .join(Shard, Shard.file_id == CheckpointFile.id)
            .where(Checkpoint.released_at.is_(None)).distinct()).subquery()
    sent = (select(func.coalesce(func.sum(ContentCopy.size), 0))  # a copy's size is its content's
            .where(ContentCopy.sha256 == refs.c.sha, ContentCopy.state.in_(sorted(states.SENT)))
            .scalar_subquery())
    rows = session.execute(select(refs.c.run, refs.c.sha, sent)).all()
    runs_of = Counter(sha for _run, sha, _size in rows)  # whether a content is shared: over every run
    wanted = set(runs) if runs is not None else None
    out: dict[str, dict[str, int]] = {}
    for run, sha, size in rows:
        if wanted is None or run in wanted:
            entry = out.setdefault(run, {"unique": 0, "shared": 0})
            entry["shared" if runs_of[sha] > 1 else "unique"] += int(size or 0)
    return out


def capacity_reason(s: Session, settings: Settings, contents: list[Content], rf: int) -> str:
    """Why copies cannot be placed, in numbers: what is missing, on how many workers, for
    ``contents`` to have ``rf`` copies each (their checkpoint's run's RF, or one content's)."""
    counting = {w.id for w in s.scalars(select(StorageWorker).where(StorageWorker.state.in_(sorted(COUNTING_WORKERS)),
                                                                    StorageWorker.tier == states.Tier.WORKERS))}
    need = workers = 0
    for c in contents:
        have = sum(1 for cp in c.copies if cp.state in PLACED and cp.worker_id in counting)
        need += max(0, rf - have) * c.size
        workers = max(workers, rf - have)
    placeable = len(live_candidates(s))
    total = s.scalar(select(func.count(StorageWorker.id)).where(
        StorageWorker.state.in_(sorted(COUNTING_WORKERS)), StorageWorker.tier == states.Tier.WORKERS)) or 0
    only = "only " if placeable < workers else ""
    damaged = sorted({cp.worker_id for c in contents for cp in c.copies
                      if cp.state in DAMAGED and cp.worker_id in counting})
    if damaged:  # one copy per worker: those workers take none until theirs is rebuilt in place
        return (f"waiting for repair: {len(damaged)} of {total} workers ({', '.join(damaged[:5])}) hold a "
                f"damaged copy of its content, and a worker holds one copy of a content; it goes on once "
                f"the repair has rebuilt them (needs {human_bytes(need)} more on {workers} distinct workers, "
                f"{placeable} take new copies)")
    return (f"cluster full: needs {human_bytes(need)} more on {workers} distinct workers, and {only}"
            f"{placeable} of {total} workers take new copies (high watermark {settings.high_watermark:.0%}); "
            "it goes on when a worker has room (after `ckpt gc`, or a new worker)")
