"""Retention, pure: which local checkpoints of a run rotate away, and which protected
checkpoints stay restorable from the storage workers.

"Newest" is one definition everywhere (docs/design.md, "The newest save"): the most recently
completed save, by the time its content was complete (its newest file's modification time),
then the writer's own step (Trainer ``global_step``, else the step in its name), then
detection order (the checkpoint id): :func:`recency`. When in doubt, keep: whatever the
order, nothing drops the newest of a run by any of the three measures (:func:`newest_ids`),
so a copy that moved a modification time or a name without digits never makes the newest
save look old.

Locally, keep the newest ``keep_last`` checkpoints of each run. Whether a candidate may
really be deleted is decided elsewhere (pipeline.store.rotation).

Remotely, a :class:`Policy` keeps checkpoints by count, step, calendar bucket and metric;
the ones it drops are forgotten (pipeline.integrity.retention) and their content collected
once nothing kept references it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol


@dataclass(frozen=True)
class LocalCheckpoint:
    id: int
    step: int | None
    #: When its content was complete: its newest file's modification time (seconds).
    mtime: float
    #: Checkpoints one save wrote side by side share a group (pipeline.core.savegroups.save_group).
    group: str = ""


class _Saved(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def step(self) -> int | None: ...
    @property
    def group(self) -> str: ...


def recency(completed: float, step: int | None, id: int) -> tuple[float, int, int]:
    """The sort key of "newest": completion time, then the writer's step, then detection order."""
    return (completed, step if step is not None else -1, id)


def newest_ids(items: Iterable[_Saved], completed: Callable[[Any], float]) -> set[int]:
    """The newest of ``items`` by each measure on its own: completion time, step, detection
    order. What no retention rule ever drops."""
    items = list(items)
    if not items:
        return set()
    out = {max(items, key=lambda c: (completed(c), c.id)).id, max(items, key=lambda c: c.id).id}
    stepped = [c for c in items if c.step is not None]
    if stepped:
        # Of two saves of the same step (a re-save), the one completed last.
        out.add(max(stepped, key=lambda c: (c.step, completed(c), c.id)).id)
    # A save written as several files side by side (a sharded model saved into the run itself:
    # its shards and index) is one save: the newest keeps every file of it.
    groups = {c.group for c in items if c.id in out and c.group}
    return out | {c.id for c in items if c.group in groups}


def newest_first(items: list[LocalCheckpoint]) -> list[LocalCheckpoint]:
    return sorted(items, key=lambda c: recency(c.mtime, c.step, c.id), reverse=True)


def to_rotate(items: list[LocalCheckpoint], keep_last: int) -> list[int]:
    """Ids of the checkpoints beyond the newest ``keep_last``, oldest last; never one of the
    newest by any measure (:func:`newest_ids`)."""
    never = newest_ids(items, lambda c: c.mtime)
    return [c.id for c in newest_first(items)[keep_last:] if c.id not in never]


# -- remote retention: which protected checkpoints stay restorable -------------------------

#: Time buckets of the calendar rules, as restic forms them (in UTC here).
_BUCKETS: dict[str, Callable[[datetime], tuple[int, ...]]] = {
    "hourly": lambda t: (t.year, t.month, t.day, t.hour),
    "daily": lambda t: (t.year, t.month, t.day),
    "weekly": lambda t: tuple(t.isocalendar()[:2]),
    "monthly": lambda t: (t.year, t.month),
}


@dataclass(frozen=True)
class Policy:
    """Which remote copies a run keeps (restic's and Orbax's vocabulary). 0 means a rule is off;
    a policy with every rule off keeps everything."""

    keep_last: int = 0
    keep_every: int = 0   # every checkpoint whose step is a multiple of this
    hourly: int = 0
    daily: int = 0
    weekly: int = 0
    monthly: int = 0
    best: int = 0         # the best ``best`` by ``metric`` (``mode`` min or max)
    metric: str = ""
    mode: str = "min"

    @property
    def is_set(self) -> bool:
        return any((self.keep_last, self.keep_every, self.hourly, self.daily, self.weekly, self.monthly, self.best))

    def describe(self) -> str:
        if not self.is_set:
            return "none (every protected checkpoint is kept)"
        parts = [f"last {self.keep_last}" if self.keep_last else "",
                 f"every {self.keep_every} steps" if self.keep_every else "",
                 *(f"{n} {name}" for name, n in (("hourly", self.hourly), ("daily", self.daily),
                                                  ("weekly", self.weekly), ("monthly", self.monthly)) if n),
                 f"best {self.best} by {self.mode} {self.metric}" if self.best else ""]
        return ", ".join(p for p in parts if p)


@dataclass(frozen=True)
class Protected:
    """A protected checkpoint of one run, as the remote policy sees it."""

    id: int
    step: int | None
    saved_at: datetime
    pinned: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)
    group: str = ""


def _completed(c: Protected) -> float:
    return c.saved_at.timestamp()


def _newest_first(items: Iterable[Protected]) -> list[Protected]:
    return sorted(items, key=lambda c: recency(_completed(c), c.step, c.id), reverse=True)


def kept(items: Iterable[Protected], policy: Policy) -> dict[int, list[str]]:
    """Per kept checkpoint, why (every rule that keeps it). Deterministic.

    A checkpoint is kept when any rule keeps it (the rules add up, as restic's do); pins and
    the newest checkpoint of the run (by each measure of :func:`newest_ids`) are always kept,
    and so is everything when no rule is set.
    """
    ordered = _newest_first(items)
    why: dict[int, list[str]] = {}

    def keep(c: Protected, reason: str) -> None:
        why.setdefault(c.id, []).append(reason)

    if not ordered:
        return why
    newest = newest_ids(ordered, _completed)
    for c in ordered:
        if c.id in newest:
            keep(c, "newest")
    for c in ordered:
        if c.pinned:
            keep(c, "pinned")
    if not policy.is_set:
        for c in ordered:
            keep(c, "no policy")
        return why
    for c in ordered[:policy.keep_last]:
        keep(c, "last")
    if policy.keep_every:
        for c in ordered:
            if c.step is not None and c.step % policy.keep_every == 0:
                keep(c, f"every {policy.keep_every}")
    for name, n in (("hourly", policy.hourly), ("daily", policy.daily), ("weekly", policy.weekly),
                    ("monthly", policy.monthly)):
        seen: set[tuple[int, ...]] = set()
        bucket = _BUCKETS[name]
        for c in sorted(ordered, key=lambda c: (c.saved_at, c.step or 0, c.id), reverse=True):
            if len(seen) >= n:
                break
            b = bucket(c.saved_at.astimezone(UTC))
            if b not in seen:  # the newest checkpoint of each of the last n buckets
                seen.add(b)
                keep(c, name)
    if policy.best and policy.metric:
        scored = [c for c in ordered if isinstance(c.metrics.get(policy.metric), (int, float))
                  and math.isfinite(c.metrics[policy.metric])]
        sign = 1 if policy.mode == "min" else -1
        # Ties go to the newer checkpoint (``ordered`` is newest first and the sort is stable).
        for c in sorted(scored, key=lambda c: sign * c.metrics[policy.metric])[:policy.best]:
            keep(c, f"best {policy.metric}")
    return why


def to_forget(items: Iterable[Protected], policy: Policy) -> list[int]:
    """Ids of the checkpoints the policy drops, oldest first."""
    items = list(items)
    keep = kept(items, policy)
    return [c.id for c in reversed(_newest_first(items)) if c.id not in keep]
