"""A restore *by path* means the current version at that path, and only while the files on
disk are that version (docs/design.md, section 2, "The current version of a path is what is
on disk now").

When the files there changed since (saved again and not recorded yet, killed halfway, edited
in place), the path's newest content is not protected: giving back the recorded version
would silently return older weights than the ones the user sees. Such a restore is refused,
naming what changed and how to get the recorded version anyway (by its id).
"""
from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import Checkpoint
from pipeline.detection.catalog import on_host, own_files
from pipeline.detection.ondisk import differs
from pipeline.errors import RestoreError, UnsafeDestination
from pipeline.settings import Settings


def check(settings: Settings, ckpt: Checkpoint, dest: Path) -> None:
    """Raise if the files at ``ckpt.path`` are not the version a restore by path would give."""
    why = ckpt.disk_changed
    if why is None and ckpt.host in (None, settings.host_id) and os.path.lexists(ckpt.path):
        if ckpt.local_present:
            why = differs(Path(ckpt.path), ckpt.is_dir, own_files(ckpt), by_content=True)
        else:
            why = f"its local copy was rotated, and {ckpt.path} holds other files now"
    if why is None:
        return
    raise RestoreError(
        f"{ckpt.path} changed on disk since its protected version (checkpoint {ckpt.id}) was recorded, and the "
        f"new content is not protected: {why}. Restoring by path would give back the older version; "
        f"to get that version anyway, name it by id: `ckpt restore {ckpt.id} --to {dest}`")


def check_target(session: Session, settings: Settings, ckpt: Checkpoint, target: Path,
                 asked: Path | None = None) -> None:
    """Refuse to restore ``ckpt`` to the path of another kept version (current, not released)
    whose content differs, whether its files are there or were deleted: the watcher would
    record the restored bytes as that path's new version and release the one it replaces,
    whose content the collection would then delete. ``target`` is resolved; ``asked`` is the
    path as given: a checkpoint recorded under a link that leads to ``target`` counts too."""
    paths = {str(target)} | ({str(asked)} if asked is not None else set())
    near = session.scalars(select(Checkpoint).where(
        Checkpoint.run.in_(sorted({os.path.dirname(p) for p in paths})) | Checkpoint.path.in_(sorted(paths)),
        Checkpoint.current.is_(True), Checkpoint.released_at.is_(None), Checkpoint.version != ckpt.version,
        on_host(settings.host_id)))
    other = next((c for c in near if c.path in paths or os.path.realpath(c.path) == str(target)), None)
    if other is not None:
        raise UnsafeDestination(
            f"{target} is the path of checkpoint {other.id}, whose content differs from checkpoint {ckpt.id}'s: "
            f"restored there, checkpoint {ckpt.id}'s files would become that path's new version and checkpoint "
            f"{other.id} would be released (and its content collected); restore to a new path instead")
