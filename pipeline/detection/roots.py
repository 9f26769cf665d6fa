"""Watched roots, runs and checkpoint names (docs/design.md, section 2).

A root is a directory or a glob; every directory it matches is a run; every entry directly
inside a run is one checkpoint, unless its name marks it as temporary or as one of the run's
own files (pipeline.core.layouts.RUN_FILES: DeepSpeed's ``latest``, a ``config.json``, log
directories), or it is a symlink. A glob never follows a symlink out of the root: a run that
is a link is skipped, so rotation can never empty a directory it points to.
"""
from __future__ import annotations

import fnmatch
import glob
import logging
import os
from pathlib import Path

from pipeline.core.layouts import run_file_reason
from pipeline.core.layouts import step_of as _step_of
from pipeline.errors import OutsideRoots

log = logging.getLogger("ckpt.roots")

#: Names a trainer uses while it is still writing; never checkpoints.
TEMPORARY_PATTERNS = ("*.tmp", "*.part", "*.partial", "*.incomplete", "*.orbax-checkpoint-tmp-*", "*.lock",
                      "tmp-checkpoint-*")
_warned: set[str] = set()


def is_temporary(name: str) -> bool:
    """True for hidden names and the temporary names trainers write before renaming."""
    return name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in TEMPORARY_PATTERNS)


def step_of(name: str) -> int | None:
    """The training step in a checkpoint's name by the known patterns (pipeline.core.layouts)."""
    return _step_of(name)


def runs_of(roots: tuple[str, ...] | list[str]) -> list[tuple[str, Path]]:
    """``(root, run)`` for every run directory the roots match, resolved, without duplicates.

    A root named without a glob is taken as given (a link the user chose is followed); a
    directory that a glob matches is a run only if it is not a symlink.
    """
    found: dict[str, tuple[str, Path]] = {}
    for root in roots:
        pattern = os.path.expanduser(root)
        if glob.has_magic(pattern):
            matches = []
            for m in sorted(glob.glob(pattern)):
                if os.path.islink(m):
                    if m not in _warned:
                        _warned.add(m)
                        log.warning("not watching %s: a symlink is never followed out of the root %s", m, root)
                    continue
                matches.append(m)
        else:
            matches = [pattern]
        for m in matches:
            p = Path(m).resolve()
            if p.is_dir():
                found.setdefault(str(p), (root, p))
    return list(found.values())


def run_parents(roots: tuple[str, ...] | list[str]) -> list[Path]:
    """The existing directories in which a root's glob finds runs by their last name only
    (``/data/runs/*`` -> ``/data/runs``): where a new run appears."""
    out = []
    for root in roots:
        pattern = os.path.expanduser(root)
        parent, last = os.path.split(pattern)
        if glob.has_magic(last) and not glob.has_magic(parent) and os.path.isdir(parent):
            out.append(Path(parent).resolve())
    return sorted(set(out))


def runs(roots: tuple[str, ...] | list[str]) -> list[Path]:
    """Every run directory the roots match."""
    return [run for _root, run in runs_of(roots)]


def checkpoints_in(run: Path) -> list[Path]:
    """The checkpoint entries of one run: not temporary, not the run's own files, not links."""
    try:
        entries = sorted(os.scandir(run), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        if is_temporary(e.name):
            continue
        is_link = e.is_symlink()
        is_dir = e.is_dir(follow_symlinks=False)
        if run_file_reason(e.name, is_dir, is_link) is None and (is_dir or e.is_file(follow_symlinks=False)):
            out.append(Path(e.path))
    return out


def locate(path: str | os.PathLike[str], roots: tuple[str, ...] | list[str]) -> tuple[Path, Path]:
    """``(run, checkpoint)`` for a path naming a checkpoint under a watched root.

    Raises :class:`OutsideRoots` when ``path`` is not an entry directly inside a run.
    """
    p = Path(os.path.abspath(path))
    for run in runs(roots):
        if Path(os.path.realpath(p.parent)) == run and not is_temporary(p.name):
            return run, run / p.name
    raise OutsideRoots(str(path), list(roots))


def root_of(run: Path, roots: tuple[str, ...] | list[str]) -> str | None:
    """The root pattern that made ``run`` a run."""
    return next((root for root, r in runs_of(roots) if r == run), None)
