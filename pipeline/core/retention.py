"""Retention: which local checkpoints of a run the policy wants gone. Pure.

Keep the newest ``keep_last`` checkpoints of each run; "newest" is by the step number in
the name (pipeline.core.layouts.step_of) when both have one, then by detection order (the
checkpoint id), never by the last digits of a name or a modification time a copy can change.
Whether a candidate may really be deleted is decided elsewhere (pipeline.store.rotation).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalCheckpoint:
    id: int
    step: int | None
    mtime: float


def newest_first(items: list[LocalCheckpoint]) -> list[LocalCheckpoint]:
    return sorted(items, key=lambda c: (c.step is not None, c.step or 0, c.id), reverse=True)


def to_rotate(items: list[LocalCheckpoint], keep_last: int) -> list[int]:
    """Ids of the checkpoints beyond the newest ``keep_last``, oldest last."""
    return [c.id for c in newest_first(items)[keep_last:]]
