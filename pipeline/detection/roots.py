"""Watched roots, runs and checkpoint names (docs/design.md, section 2).

A root is a directory or a glob; every directory it matches is a run; every entry directly
inside a run is one checkpoint, unless its name marks it as temporary or as one of the run's
own files (pipeline.core.layouts.RUN_FILES: DeepSpeed's ``latest``, a ``config.json``, log
directories). Nothing is followed out of a root: a glob match, or a symlinked checkpoint,
that resolves outside the root's base (:func:`base_of`) through any link is refused and
listed with the reason; one that stays inside is followed and named as the user sees it.
"""
from __future__ import annotations

import fnmatch
import glob
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.layouts import run_file_reason
from pipeline.core.layouts import step_of as _step_of
from pipeline.errors import OutsideRoots

#: Names a trainer uses while it is still writing; never checkpoints.
TEMPORARY_PATTERNS = ("*.tmp", "*.part", "*.partial", "*.incomplete", "*.orbax-checkpoint-tmp-*", "*.lock",
                      "tmp-checkpoint-*")


def is_temporary(name: str) -> bool:
    """True for hidden names and the temporary names trainers write before renaming."""
    return name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in TEMPORARY_PATTERNS)


def step_of(name: str) -> int | None:
    """The training step in a checkpoint's name by the known patterns (pipeline.core.layouts)."""
    return _step_of(name)


@dataclass(frozen=True)
class Refused:
    """An entry a root reaches only through a symlink that leaves the root: never a run nor a
    checkpoint (not uploaded, not rotated), listed in "not protected" with ``reason``."""

    path: str    # as the user sees it
    run: str     # the run it is in, or the directory it was found in
    reason: str


def base_of(root: str) -> Path:
    """The directory a root confines everything to: for a glob, its path up to the first
    component with a wildcard; for a plain root, the root. Resolved: links the user wrote in
    it are the user's choice; links found below it must stay inside it."""
    pattern = os.path.expanduser(root)
    parts = Path(os.path.abspath(pattern)).parts
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts))
    return Path(os.path.realpath(os.path.join(*fixed)))


def inside(real: str | os.PathLike[str], base: Path) -> bool:
    """Whether the resolved path ``real`` is ``base`` or below it."""
    real = os.fspath(real)
    return real == str(base) or real.startswith(str(base).rstrip(os.sep) + os.sep)


def expand(roots: tuple[str, ...] | list[str]) -> tuple[list[tuple[str, Path, Path]], list[Refused]]:
    """``(root, run as seen, base)`` of every run (:func:`runs_of`), and the glob matches refused."""
    found: dict[str, tuple[str, Path, Path]] = {}
    refused = []
    for root in roots:
        pattern = os.path.expanduser(root)
        base = base_of(root)
        if not glob.has_magic(pattern):
            real = os.path.realpath(pattern)
            if os.path.isdir(real):
                found.setdefault(real, (root, Path(real), base))
            continue
        fixed = Path(os.path.abspath(pattern)).parts
        prefix = os.path.join(*itertools.takewhile(lambda part: not glob.has_magic(part), fixed))
        for m in sorted(glob.glob(os.path.abspath(pattern))):
            real = os.path.realpath(m)
            seen = base / os.path.relpath(m, prefix)
            if not inside(real, base):
                refused.append(Refused(str(seen), str(seen.parent),
                                       f"a symlink on the way leads to {real}, outside the root {root} ({base}):"
                                       " a link out of a root is never followed"))
                continue
            if not os.path.isdir(real):
                continue
            if real not in found or str(seen) == real:  # a run reached also without a link: its own path
                found[real] = (root, seen, base)
    return list(found.values()), refused


def runs_of(roots: tuple[str, ...] | list[str]) -> list[tuple[str, Path]]:
    """``(root, run)`` for every run directory the roots match, without duplicates.

    A root named without a glob is taken as given (a link the user chose is followed, and the
    run is its resolved path). A directory a glob matches is a run if it resolves inside the
    root's base (:func:`base_of`), through links or not; it is named as the user sees it
    (the base, then the components the glob matched). One that resolves outside is refused
    (:func:`refused_runs`), whichever component is the link.
    """
    return [(root, run) for root, run, _base in expand(roots)[0]]


def refused_runs(roots: tuple[str, ...] | list[str]) -> list[Refused]:
    """The directories the roots' globs match only through a link that leaves the root."""
    return expand(roots)[1]


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


def checkpoints_in(run: Path, base: Path | None = None) -> list[Path]:
    """The checkpoint entries of one run (see :func:`entries_in`)."""
    return entries_in(run, base)[0]


def entries_in(run: Path, base: Path | None = None, runs_real: frozenset[str] = frozenset()
               ) -> tuple[list[Path], list[Refused]]:
    """The checkpoint entries of one run (not temporary, not the run's own files), and the
    symlinked entries refused.

    A symlinked entry is followed when its target resolves inside ``base`` (the root's base;
    the run itself when None) and recorded under its own name in the run; one whose target
    leaves it is refused. A link to an entry of a run (``latest -> checkpoint-500``) is a
    pointer to a checkpoint detected under its own name: skipped. A dangling link is skipped.
    """
    try:
        entries = sorted(os.scandir(run), key=lambda e: e.name)
    except FileNotFoundError:
        return [], []
    base = base if base is not None else Path(os.path.realpath(run))
    runs_real = runs_real | {os.path.realpath(run)}
    out, refused = [], []
    for e in entries:
        if is_temporary(e.name):
            continue
        if e.is_symlink():
            real = os.path.realpath(e.path)
            if not os.path.exists(real):
                continue
            if not inside(real, base):
                refused.append(Refused(e.path, str(run), f"a symlink to {real}, outside the root ({base}): a link"
                                                         " out of a root is never followed"))
                continue
            if os.path.dirname(real) in runs_real:
                continue
            is_dir = os.path.isdir(real)
            if run_file_reason(e.name, is_dir, False) is None and (is_dir or os.path.isfile(real)):
                out.append(Path(e.path))
            continue
        is_dir = e.is_dir(follow_symlinks=False)
        if run_file_reason(e.name, is_dir, False) is None and (is_dir or e.is_file(follow_symlinks=False)):
            out.append(Path(e.path))
    return out, refused


def locate(path: str | os.PathLike[str], roots: tuple[str, ...] | list[str]) -> tuple[Path, Path]:
    """``(run, checkpoint)`` for a path naming a checkpoint under a watched root, by the rules
    the watcher follows (a run or a checkpoint reached through a link out of its root is not
    one). Raises :class:`OutsideRoots` when ``path`` is not an entry directly inside a run.
    """
    p = Path(os.path.abspath(path))
    parent = os.path.realpath(p.parent)
    for _root, run, base in expand(roots)[0]:
        if os.path.realpath(run) != parent or is_temporary(p.name):
            continue
        ckpt = run / p.name
        if os.path.islink(ckpt) and not inside(os.path.realpath(ckpt), base):
            break
        return run, ckpt
    raise OutsideRoots(str(path), list(roots))


def base_for(run: Path, roots: tuple[str, ...] | list[str]) -> Path | None:
    """The base (:func:`base_of`) of the root that made ``run`` a run, if any does now."""
    return next((base for _root, r, base in expand(roots)[0] if r == run), None)


def root_of(run: Path, roots: tuple[str, ...] | list[str]) -> str | None:
    """The root pattern that made ``run`` a run."""
    return next((root for root, r in runs_of(roots) if r == run), None)
