"""Durable writes (docs/design.md, invariant 2): fsync a directory after renaming into it."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink inside ``path`` survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, readable by this user only (0600): a temporary name,
    fsynced, renamed, the directory fsynced. For files that may hold secrets (up.json can
    hold a database URL with its password)."""
    replace_file(path, text, mode=0o600)


def replace_file(path: Path, text: str, *, mode: int) -> None:
    """Replace ``path`` with ``text`` (permissions ``mode``) atomically and durably: a reader
    sees the old file or the new one, and a crash leaves one of them."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # a leftover temporary file keeps its old mode otherwise
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_once(path: Path, text: str, mode: int = 0o644) -> bool:
    """Create ``path`` holding ``text`` unless it exists; False if another process (or an
    earlier run) made it first. Durable (fsynced, linked into place, the directory fsynced),
    and never torn: two processes racing both read the first writer's text afterwards."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # first writer wins
        made = True
    except FileExistsError:
        made = False
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)
    return made


def open_private_log(path: Path) -> int:
    """A log file opened for appending, readable by this user only (logs echo URLs)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, looked up on the first file written behind (not at import: every
    command imports this module, and ctypes with it)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
        return fn
    except (OSError, AttributeError):  # not Linux/glibc: the final fsync does all the work
        return None


class WriteBehind:
    """Streams a sequentially written file to the disk as it grows.

    Every ``window`` bytes it starts the write-out of that window and waits for the one
    before it (sync_file_range), so the file never has more than two windows of dirty pages:
    the writer is not stalled by the kernel's dirty-page throttling halfway through a large
    file, and the final fsync has little left to do. It does not replace that fsync.
    """

    def __init__(self, fd: int, window: int = 32 * 1024 * 1024, *, evict: bool = True) -> None:
        self.fd, self.window, self.evict = fd, window, evict
        self.started = 0  # bytes whose write-out has been started

    def written(self, upto: int) -> None:
        """The file is complete up to byte ``upto``."""
        sync_file_range = _sync_file_range()
        if sync_file_range is None:
            return
        while upto - self.started >= self.window:
            sync_file_range(self.fd, self.started, self.window, _SYNC_FILE_RANGE_WRITE)
            if self.started >= self.window:
                prev = self.started - self.window
                sync_file_range(self.fd, prev, self.window,
                                _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)
                if self.evict:
                    os.posix_fadvise(self.fd, prev, self.window, os.POSIX_FADV_DONTNEED)
            self.started += self.window
