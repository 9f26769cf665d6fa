"""Watched roots, runs and checkpoint names (docs/design.md, section 2).

A root is a directory or a glob; every directory it matches is a run; every entry
directly inside a run is one checkpoint, unless its name marks it as temporary.
"""
from __future__ import annotations

import fnmatch
import glob
import os
import re
from pathlib import Path

from pipeline.errors import OutsideRoots

#: Names a trainer uses while it is still writing; never checkpoints.
TEMPORARY_PATTERNS = ("*.tmp", "*.part", "*.partial", "*.incomplete", "*.orbax-checkpoint-tmp-*", "*.lock")

_STEP = re.compile(r"(\d+)(?!.*\d)")


def is_temporary(name: str) -> bool:
    """True for hidden names and the temporary names trainers write before renaming."""
    return name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in TEMPORARY_PATTERNS)


def step_of(name: str) -> int | None:
    """The step number in a checkpoint's name: its last run of digits (``checkpoint-500`` -> 500)."""
    m = _STEP.search(name)
    return int(m.group(1)) if m else None


def runs(roots: tuple[str, ...] | list[str]) -> list[Path]:
    """Every run directory the roots match, resolved, without duplicates."""
    found: dict[str, Path] = {}
    for root in roots:
        pattern = os.path.expanduser(root)
        matches = glob.glob(pattern) if glob.has_magic(pattern) else [pattern]
        for m in sorted(matches):
            p = Path(m).resolve()
            if p.is_dir():
                found.setdefault(str(p), p)
    return list(found.values())


def checkpoints_in(run: Path) -> list[Path]:
    """The checkpoint entries of one run (temporary names excluded)."""
    try:
        entries = sorted(os.scandir(run), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [Path(e.path) for e in entries if not is_temporary(e.name) and (e.is_file() or e.is_dir())]


def locate(path: str | os.PathLike[str], roots: tuple[str, ...] | list[str]) -> tuple[Path, Path]:
    """``(run, checkpoint)`` for a path naming a checkpoint under a watched root.

    Raises :class:`OutsideRoots` when ``path`` is not an entry directly inside a run.
    """
    p = Path(path).resolve()
    for run in runs(roots):
        if p.parent == run and not is_temporary(p.name):
            return run, p
    raise OutsideRoots(str(path), list(roots))
