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
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path

from pipeline.durable import fsync_dir
from pipeline.errors import OutsideRoots

PREFIX = ".ckpt-trash-"


def _run_fd(path: Path, inside: Path | None) -> int:
    """The open directory holding ``path``, checked (by what was opened, not by its name
    again) to be ``inside`` that directory when given: a link on the way that was
    retargeted out of the root since detection is never followed to delete."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    if inside is None:
        return fd
    try:
        real = os.readlink(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else os.path.realpath(path.parent)
    except OSError:
        real = os.path.realpath(path.parent)
    if real != str(inside) and not real.startswith(str(inside).rstrip(os.sep) + os.sep):
        os.close(fd)
        raise OutsideRoots(str(path), [str(inside)])
    return fd


def move_to_trash(path: Path, inside: Path | None = None) -> str:
    """Rename the checkpoint to a hidden name in its run (atomic; the watcher ignores it).
    A symlinked checkpoint: the link is renamed, never what it points to. ``inside``: the
    root's base the run must resolve into (raises :class:`OutsideRoots` otherwise)."""
    name = f"{PREFIX}{uuid.uuid4().hex[:8]}-{path.name}"
    fd = _run_fd(path, inside)
    try:
        os.rename(path.name, name, src_dir_fd=fd, dst_dir_fd=fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    return str(path.parent / name)


def entries(run: str | Path) -> list[tuple[Path, Path]]:
    """(trash entry, the checkpoint path it was) for every trash entry in ``run``."""
    run = Path(run)
    try:
        names = os.listdir(run)
    except FileNotFoundError:
        return []
    return [(run / e, run / e[len(PREFIX) + 9:]) for e in names
            if e.startswith(PREFIX) and len(e) > len(PREFIX) + 9 and e[len(PREFIX) + 8] == "-"]


def remove(entry: Path, inside: Path | None = None) -> None:
    """Delete a trash entry (a link: the link only), through its run's directory as opened
    and checked (see :func:`move_to_trash`)."""
    fd = _run_fd(entry, inside)
    try:
        st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(entry.name, dir_fd=fd)
        else:
            os.unlink(entry.name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def _files(entry: Path) -> list[tuple[str, int, int]]:
    """(relpath, size, mtime_ns) of every regular file of a trash entry ("" for a file)."""
    st = os.lstat(entry)
    if stat.S_ISREG(st.st_mode):
        return [("", st.st_size, st.st_mtime_ns)]
    out = []
    for dirpath, _dirs, names in os.walk(entry):
        for name in names:
            full = os.path.join(dirpath, name)
            fst = os.lstat(full)
            if stat.S_ISREG(fst.st_mode):
                out.append((os.path.relpath(full, entry), fst.st_size, fst.st_mtime_ns))
    return sorted(out)


def put_back(path: str | Path, files: Iterable[tuple[str, int, int]]) -> bool:
    """Undo the trash rename of a rotation that crashed before it committed.

    Only the caller knows that no rotation of ``path`` committed (the checkpoint is still
    recorded as present), and which version that is: ``files``, its (relpath, size, mtime_ns).
    The entry comes back only if it holds exactly those files (a rename keeps them): the
    leftover of an older version's rotation that did commit is never put back over a newer
    one. True if ``path`` was missing and came back from the trash.
    """
    path = Path(path)
    if os.path.lexists(path):
        return False
    mine = [entry for entry, was in entries(path.parent) if was == path]
    if len(mine) != 1 or _files(mine[0]) != sorted(files):
        return False
    os.rename(mine[0], path)
    fsync_dir(path.parent)
    return True
