"""The rotation trash: how a local checkpoint is deleted atomically with its decision.

Rotation renames the checkpoint to a hidden name in its run inside the deciding
transaction, and deletes it only after that transaction committed. A crash in between
leaves a trash entry whose deletion was never decided: :func:`put_back` renames it back
before anyone concludes that the checkpoint vanished. A crash after the commit leaves one
whose deletion was decided: the next rotation of the run removes it.

What the rename moved is checked again before it is deleted (pipeline.store.rotation): a save
that took the path between rotation's check and its rename (a trainer renaming a new save over
it), or that was written through a file it held open, is not what was stored, and goes back
with :func:`restore`, never over anything at the path since.
"""
from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable
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


def restore(entry: str | Path, path: str | Path) -> Path:
    """Rename a trash entry back to ``path``, never over what is there now: a save that took the
    path since keeps it, and the entry goes to a name of its own beside it instead
    (``step_7.kept-1a2b3c4d.safetensors``), where the watcher finds it. Where it went."""
    entry, path = Path(entry), Path(path)
    if not _rename_noreplace(entry, path):
        stem, dot, suffix = path.name.partition(".") if not os.path.isdir(entry) else (path.name, "", "")
        path = path.with_name(f"{stem}.kept-{uuid.uuid4().hex[:8]}{dot}{suffix}")
        os.rename(entry, path)  # a name of its own: nothing there to replace
    fsync_dir(path.parent)
    return path


#: renameat2(2)'s flag: fail with EEXIST rather than replace what is at the new name.
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's renameat2, or None where there is none (loaded once, when first needed)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda src, dst: 0 if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                                    _RENAME_NOREPLACE) == 0 else ctypes.get_errno()


def _rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` unless something is at ``dst`` (then False, nothing moved).
    The kernel's no-replace rename where the filesystem has it; else a file or link is linked
    then unlinked (the kernel refuses a link over anything), and a directory renamed, which the
    kernel refuses over a file or a directory with anything in it."""
    rename2 = _renameat2()
    if rename2 is not None:
        err = rename2(src, dst)
        if err == 0:
            return True
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):  # not on this filesystem
            raise OSError(err, os.strerror(err), str(src))
    if not os.path.isdir(src) or os.path.islink(src):
        try:
            os.link(src, dst, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as exc:  # no hard links here (or not to another's file): a name of its own
            # (a rename checked first could still replace a save made in between)
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            return False
        os.unlink(src)
        return True
    if os.path.lexists(dst):
        return False
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            return False
        raise
    return True


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
    if not _rename_noreplace(mine[0], path):  # a save took the path since the check above
        return False
    fsync_dir(path.parent)
    return True
