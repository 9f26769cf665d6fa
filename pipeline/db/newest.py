"""A run's newest checkpoints as the control plane answers them (docs/design.md, "The newest
save"): what ``ckpt status``, the UI and ``latest()`` name, each one lookup along the (run,
current, mtime, id) index, whatever the run's length."""
from __future__ import annotations

import os
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.core.savegroups import save_group, whole_save
from pipeline.db.models import Checkpoint


def newest_first() -> tuple[Any, ...]:
    """Checkpoints newest first, as pipeline.core.retention.recency orders them: by when their
    content was complete, then the writer's step, then detection order."""
    return (Checkpoint.mtime.desc(), func.coalesce(Checkpoint.step, -1).desc(), Checkpoint.id.desc())


def newest(session: Session, run: str, *where: ColumnElement[bool]) -> Checkpoint | None:
    """The run's newest current checkpoint matching ``where``."""
    return session.scalar(select(Checkpoint).where(Checkpoint.run == run, Checkpoint.current.is_(True), *where)
                          .order_by(*newest_first()).limit(1))


def newest_protected(session: Session, run: str) -> tuple[Checkpoint, list[Checkpoint]] | None:
    """The run's newest protected save: its checkpoint, and the other files of that save when it
    wrote several side by side into the run (``save_pretrained(run, max_shard_size=...)``:
    pipeline.core.savegroups.save_group; then the checkpoint is its index, the others the shards
    it names: ``whole_save``), answered only once every one of them is protected: a save with
    a file not protected yet, or not recorded, is passed over for the one before it. None if
    there is none."""
    protected = Checkpoint.store_state.in_(sorted(states.PROTECTED))
    passed: list[int] = []
    while (c := newest(session, run, protected, *([Checkpoint.id.not_in(passed)] if passed else []))) is not None:
        group = "" if c.is_dir else save_group(c.name)
        if not group:
            return c, []
        stem = os.path.splitext(group)[0]  # the shards' and the index's names start with it
        members = {m.name: m for m in session.scalars(
            select(Checkpoint).where(Checkpoint.run == run, Checkpoint.current.is_(True), Checkpoint.is_dir.is_(False),
                                     Checkpoint.name.startswith(stem, autoescape=True)))
            if save_group(m.name) == group}
        names = whole_save(group, {name: m.mtime for name, m in members.items()})
        if names is not None and all(members[n].store_state in states.PROTECTED for n in names):
            return members[names[0]], [members[n] for n in names[1:]]
        passed += [m.id for m in members.values()]
    return None
