"""The rotation trash: how a local checkpoint is deleted atomically with its decision.

Rotation renames the checkpoint to a hidden name in its run inside the deciding
transaction, and deletes it only after that transaction committed. A crash in between
leaves a trash entry whose deletion was never decided: :func:`put_back` renames it back
before anyone concludes that the checkpoint vanished. A crash after the commit leaves one
whose deletion was decided: the next rotation of the run removes it.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from pipeline.durable import fsync_dir

PREFIX = ".ckpt-trash-"


def move_to_trash(path: Path) -> str:
    """Rename the checkpoint to a hidden name in its run (atomic; the watcher ignores it)."""
    trash = str(path.parent / f"{PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    return trash


def entries(run: str | Path) -> list[tuple[Path, Path]]:
    """(trash entry, the checkpoint path it was) for every trash entry in ``run``."""
    run = Path(run)
    try:
        names = os.listdir(run)
    except FileNotFoundError:
        return []
    return [(run / e, run / e[len(PREFIX) + 9:]) for e in names
            if e.startswith(PREFIX) and len(e) > len(PREFIX) + 9 and e[len(PREFIX) + 8] == "-"]


def remove(entry: Path) -> None:
    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)


def put_back(path: str | Path) -> bool:
    """Undo the trash rename of a rotation that crashed before it committed.

    Only the caller knows that no rotation of ``path`` committed (the checkpoint is still
    recorded as present). True if ``path`` was missing and came back from the trash.
    """
    path = Path(path)
    if os.path.lexists(path):
        return False
    mine = [entry for entry, was in entries(path.parent) if was == path]
    if len(mine) != 1:
        return False
    os.rename(mine[0], path)
    fsync_dir(path.parent)
    return True
