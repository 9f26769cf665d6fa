"""The replication factor on storage workers of each content (docs/design.md, "Placement").

RF is chosen per run: ``rf`` in a ``[runs."<glob>"]`` table over the global ``rf``
(:meth:`pipeline.settings.Settings.rf_for`). A decision about one checkpoint (rotation, fan-in,
the shard step's placement, a store's re-drive, the verify step's replacement, its shard health)
takes its run's RF. Content is shared across runs (the same bytes in two runs are one content),
so a decision about a content (repair, the under-replication sweep, a drain, trimming a surplus
copy) takes **the content's RF: the largest RF of the runs whose live (not released) checkpoints
reference it**, and the global RF when none does (a content sent while hashing, before its
checkpoint is recorded; one waiting for its collection). A forgotten checkpoint's run no longer
counts: its content may keep fewer copies from then on.

Written once here, as SQL over ``Checkpoint.run`` (:meth:`RunRF.of_run`) and over a content's
hash (:meth:`RunRF.of_content`), so that a sweep stays one query at any number of checkpoints:
the runs are grouped, never the contents looped over. With no table setting another ``rf``
(the usual case) both are the constant global RF and nothing more is asked.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import ColumnElement, case, func, literal, select
from sqlalchemy.orm import Session

from pipeline.db.models import Checkpoint, CheckpointFile, Shard

if TYPE_CHECKING:
    from pipeline.settings import Settings


@dataclass(frozen=True)
class RunRF:
    """The workers' RF of each run with live checkpoints: ``default`` (the global ``rf``), and
    ``other``, the runs whose RF is another."""

    default: int
    other: Mapping[str, int] = field(default_factory=dict)

    def of_run(self) -> ColumnElement[int]:
        """SQL: the RF of a checkpoint's run (an expression over ``Checkpoint.run``)."""
        if not self.other:
            return literal(self.default)
        by_rf: dict[int, list[str]] = {}
        for run, rf in self.other.items():
            by_rf.setdefault(rf, []).append(run)
        return case(*[(Checkpoint.run.in_(sorted(runs)), rf) for rf, runs in sorted(by_rf.items())],
                    else_=self.default)

    def of_content(self, sha: ColumnElement[str]) -> ColumnElement[int]:
        """SQL: the RF of the content whose hash is ``sha`` (a column of the enclosing query):
        the largest RF of the runs whose live checkpoints reference it, else the default."""
        if not self.other:
            return literal(self.default)
        largest = (select(func.max(self.of_run()))
                   .select_from(Shard)
                   .join(CheckpointFile, CheckpointFile.id == Shard.file_id)
                   .join(Checkpoint, Checkpoint.id == CheckpointFile.checkpoint_id)
                   .where(Shard.sha256 == sha, Checkpoint.released_at.is_(None))
                   .scalar_subquery())
        return func.coalesce(largest, self.default)

    def of(self, session: Session, shas: Iterable[str]) -> dict[str, int]:
        """The RF of each content of ``shas``."""
        wanted = sorted(set(shas))
        if not self.other:
            return dict.fromkeys(wanted, self.default)
        out = dict.fromkeys(wanted, self.default)
        for i in range(0, len(wanted), 500):
            refs = (select(Shard.sha256, func.max(self.of_run()))
                    .join(CheckpointFile, CheckpointFile.id == Shard.file_id)
                    .join(Checkpoint, Checkpoint.id == CheckpointFile.checkpoint_id)
                    .where(Shard.sha256.in_(wanted[i:i + 500]), Checkpoint.released_at.is_(None))
                    .group_by(Shard.sha256))
            out.update({sha: int(rf) for sha, rf in session.execute(refs)})
        return out


def run_rf(session: Session, settings: Settings) -> RunRF:
    """The RF of each run that has live checkpoints, from the settings' ``[runs."<glob>"]``
    tables (one query over the distinct runs, none when no table sets ``rf``)."""
    if not settings.rf_per_run():
        return RunRF(settings.rf)
    runs = session.scalars(select(Checkpoint.run).where(Checkpoint.released_at.is_(None)).distinct())
    return RunRF(settings.rf, {run: rf for run in runs if (rf := settings.rf_for(run)) != settings.rf})


def content_rf(session: Session, settings: Settings, sha: str) -> int:
    """The RF of one content: the largest RF of the runs whose live checkpoints reference it,
    else the global RF (the runs asked are only those of its own references)."""
    if not settings.rf_per_run():
        return settings.rf
    runs = session.scalars(select(Checkpoint.run).distinct()
                           .join(CheckpointFile, CheckpointFile.checkpoint_id == Checkpoint.id)
                           .join(Shard, Shard.file_id == CheckpointFile.id)
                           .where(Shard.sha256 == sha, Checkpoint.released_at.is_(None)))
    return max((settings.rf_for(run) for run in runs), default=settings.rf)
