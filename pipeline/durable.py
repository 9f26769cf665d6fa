"""Durable writes (DESIGN invariant 2): fsync a directory after renaming into it."""
from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink inside ``path`` survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
