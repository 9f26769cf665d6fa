"""A restore's staging entry, opened once and written through file descriptors (docs/design.md,
invariant 7).

The destination's directory is opened once, component by component from ``/`` with
``O_NOFOLLOW``; the staging directory is made in it and opened once (``O_DIRECTORY |
O_NOFOLLOW``); every subdirectory and file is made and opened through the descriptor of the
directory that holds it (``mkdir``/``open`` with ``dir_fd``, ``O_NOFOLLOW`` on each), and the
result is renamed into place between the same two descriptors. No path is resolved again
after the destination was checked: a symlink planted at the staging name or inside it, or a
staging directory swapped for one, makes the restore fail, never redirects it.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from pipeline.errors import UnsafeDestination

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(path: Path) -> int:
    """A descriptor of the directory ``path`` (absolute), reached without following any
    symlink on the way: a link in any component raises :class:`UnsafeDestination`."""
    if not path.is_absolute():
        raise UnsafeDestination(f"{path} is not an absolute path")
    fd = os.open("/", _DIR_FLAGS)
    try:
        for part in path.parts[1:]:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise UnsafeDestination(f"{path}: {part!r} is not a directory reached without a symlink "
                                        f"({exc.strerror}); the restore writes nothing there") from exc
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def remove_at(dir_fd: int, name: str) -> None:
    """Remove the entry ``name`` of the directory ``dir_fd``: a tree is removed through
    descriptors, a link is unlinked, never followed; nothing there is nothing to do."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


class Staging:
    """The entry ``name`` in the destination's directory where one attempt rebuilds its
    files. ``parent_fd`` stays open until :meth:`close`."""

    def __init__(self, parent: Path, name: str, *, is_dir: bool) -> None:
        self.parent, self.name, self.is_dir = parent, name, is_dir
        self.parent_fd = open_dir(parent)
        self.fd: int | None = None  # the staging directory, when the checkpoint is one
        self.made: tuple[int, int] | None = None  # (dev, inode) of what this attempt made
        self._dirs: dict[str, int] = {}

    def create(self) -> None:
        """Make the staging entry afresh: a leftover of a crashed attempt, or anything
        planted at this predictable name, is removed first (never followed)."""
        remove_at(self.parent_fd, self.name)
        if self.is_dir:
            os.mkdir(self.name, 0o755, dir_fd=self.parent_fd)
            self.fd = os.open(self.name, _DIR_FLAGS, dir_fd=self.parent_fd)
            self.made = identity(os.fstat(self.fd))
            self._dirs[""] = self.fd

    def adopt(self) -> bool:
        """Take over the staging entry an earlier attempt of this job left verified (a crash
        came after): only a real file or directory, never a link. False if there is none."""
        try:
            st = os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not (stat.S_ISDIR(st.st_mode) if self.is_dir else stat.S_ISREG(st.st_mode)):
            return False
        self.made = identity(st)
        return True

    def place(self, relpath: str) -> tuple[int, str]:
        """(directory descriptor, file name) where the file ``relpath`` of a directory
        checkpoint is created: each directory on the way made and opened with O_NOFOLLOW."""
        if self.fd is None:
            raise UnsafeDestination("a file checkpoint has no staging directory")
        *dirs, name = relpath.split("/")
        if any(p in ("", ".", "..") for p in (*dirs, name)):
            raise UnsafeDestination(f"{relpath!r} is not a relative path inside the checkpoint")
        fd, sofar = self.fd, ""
        for d in dirs:
            sofar = f"{sofar}/{d}" if sofar else d
            if sofar not in self._dirs:
                try:  # new in a directory this attempt made: anything already there was put there
                    os.mkdir(d, 0o755, dir_fd=fd)
                    self._dirs[sofar] = os.open(d, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise UnsafeDestination(f"{self.parent / self.name / sofar} is not a directory this restore made "
                                            f"({exc.strerror}): something was put inside its staging directory; "
                                            f"nothing written through it") from exc
            fd = self._dirs[sofar]
        return fd, name

    def fsync(self) -> None:
        """fsync every directory of the staging tree (the files were fsynced as written)."""
        for fd in self._dirs.values():
            os.fsync(fd)

    def still_ours(self) -> None:
        """Raise :class:`UnsafeDestination` unless the staging name still holds what this attempt
        made (not a link, not another directory swapped in)."""
        try:
            st = os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None or self.made is None or identity(st) != self.made:
            raise UnsafeDestination(f"{self.parent / self.name} was replaced while the restore wrote it "
                                    "(a link or another entry put at the staging name): nothing put in place")

    def close(self) -> None:
        for fd in {*self._dirs.values(), *([self.fd] if self.fd is not None else [])}:
            os.close(fd)
        self._dirs.clear()
        self.fd = None
        os.close(self.parent_fd)
