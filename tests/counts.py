"""Per-run counts by state: as kept (``run_state_counts``) and as a recount of the checkpoints."""
from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline.db.models import Checkpoint, RunStateCount

Counts = dict[tuple[str, str, bool], tuple[int, int]]


def recount(session: Session) -> Counts:
    """(run, state, local copy present) -> (checkpoints, bytes), grouped from the checkpoints."""
    q = (select(Checkpoint.run, Checkpoint.store_state, Checkpoint.local_present, func.count(Checkpoint.id),
                func.coalesce(func.sum(Checkpoint.total_bytes), 0))
         .where(Checkpoint.current.is_(True), Checkpoint.store_state.is_not(None))
         .group_by(Checkpoint.run, Checkpoint.store_state, Checkpoint.local_present))
    return {(r, s, bool(lp)): (int(n), int(b)) for r, s, lp, n, b in session.execute(q)}


def kept(session: Session) -> Counts:
    """The same, as ``run_state_counts`` holds it (rows counted down to zero left out)."""
    q = select(RunStateCount).where(RunStateCount.checkpoints != 0)
    return {(c.run, c.store_state, bool(c.local_present)): (c.checkpoints, c.bytes) for c in session.scalars(q)}
