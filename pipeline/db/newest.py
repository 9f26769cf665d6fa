"""A run's newest checkpoints as the control plane answers them (docs/design.md, "The newest
save"): what ``ckpt status``, the UI and ``latest()`` name, each one lookup along the (run,
current, mtime, id) index, whatever the run's length."""
from __future__ import annotations

import os
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session, selectinload

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
    pipeline.core.savegroups; then the checkpoint is its index, the others the shards it
    names: ``whole_save``, of one host's files), answered only once every one of them is
    protected, and ranked by its index (written last). A save with a file not protected yet, or
    not recorded, is passed over for the one before it. None if there is none."""
    protected = Checkpoint.store_state.in_(sorted(states.PROTECTED))
    passed: set[int] = set()
    while (c := newest(session, run, protected, *([Checkpoint.id.not_in(passed)] if passed else []))) is not None:
        group = "" if c.is_dir else save_group(c.name)
        if not group:
            return c, []
        members = _group(session, c, group)
        names = whole_save(group, {name: written for name, (_m, written) in members.items()})
        save = [members[n][0] for n in names] if names is not None else []
        if save and all(m.store_state in states.PROTECTED for m in save):
            if c.id in {m.id for m in save}:
                return save[0], save[1:]
            # c is newer than the save its index completes (a later save's file, its index not
            # written yet): that save is ranked where its own files are, after what is newer.
            passed |= {m.id for m, _w in members.values()} - {m.id for m in save}
        else:
            passed |= {m.id for m, _w in members.values()}
        passed.add(c.id)
    return None


def _group(session: Session, c: Checkpoint, group: str) -> dict[str, tuple[Checkpoint, float]]:
    """name -> (checkpoint, when its files were written) of the current files of ``c``'s save
    group beside it, on its host."""
    stem = group.split(".", 1)[0]  # every name of the group starts with it (a shard's, an index's)
    rows = session.scalars(
        select(Checkpoint).where(Checkpoint.run == c.run, Checkpoint.current.is_(True), Checkpoint.is_dir.is_(False),
                                 Checkpoint.host.is_(None) if c.host is None else Checkpoint.host == c.host,
                                 Checkpoint.name.startswith(stem, autoescape=True))
        .options(selectinload(Checkpoint.files))).all()
    return {m.name: (m, max((f.mtime_ns for f in m.files), default=0) / 1e9) for m in rows
            if save_group(m.name) == group and os.path.dirname(m.path) == os.path.dirname(c.path)}
