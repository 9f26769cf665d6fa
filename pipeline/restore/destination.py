"""Where a restore may write (docs/design.md, invariant 7).

A restore destination is confined to the restore roots: ``CKPT_RESTORE_ROOTS`` when set,
else the parents of the watched roots; a request from the CLI or the Python API adds the
caller's current directory (the web API does not: its caller has none on this host). It is
never inside the control plane's home (the database, keys and worker data live there), and
never onto, into or above a checkpoint that is not yet protected, since an overwrite there
would replace the only copy of it.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db.models import Checkpoint
from pipeline.errors import RestoreError
from pipeline.settings import Settings


def restore_roots(settings: Settings, extra: Iterable[Path] = ()) -> list[Path]:
    """The directories a restore may write under, resolved."""
    if settings.restore_roots:
        roots = [Path(r).expanduser() for r in settings.restore_roots]
    else:
        roots = [_fixed_prefix(r).parent for r in settings.roots]
    return list(dict.fromkeys(p.resolve() for p in (*roots, *extra)))


def check(session: Session, settings: Settings, target: Path, extra_roots: Iterable[Path] = ()) -> None:
    """Raise :class:`RestoreError` unless ``target`` (resolved) may be written by a restore."""
    roots = restore_roots(settings, extra_roots)
    if not any(_within(target, r) for r in roots):
        shown = ", ".join(str(r) for r in roots) or "none: no watched roots and no CKPT_RESTORE_ROOTS"
        raise RestoreError(f"{target} is outside the restore roots ({shown}); restore under one of them, "
                           "or add a directory to CKPT_RESTORE_ROOTS")
    home = settings.home.resolve()
    if _within(target, home) or _within(home, target):
        raise RestoreError(f"{target} is inside or above the control plane's home {home}; choose another place")
    unsafe = session.scalar(
        select(Checkpoint.path).where(
            Checkpoint.current.is_(True), Checkpoint.local_present.is_(True),
            Checkpoint.store_state.not_in(sorted(states.PROTECTED)),
            or_(Checkpoint.path == str(target), Checkpoint.path.startswith(f"{target}/", autoescape=True),
                *(Checkpoint.path == str(p) for p in target.parents)))
        .limit(1))
    if unsafe is not None:
        raise RestoreError(f"{target} would overwrite {unsafe}, a checkpoint that is not protected yet (its only "
                           "copy is that local one); restore somewhere else")


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _fixed_prefix(root: str) -> Path:
    """The part of a watched root before its first glob character (``/data/runs/*`` -> ``/data/runs``)."""
    parts = Path(root).expanduser().parts
    fixed = [p for p in _until_glob(parts)]
    return Path(*fixed) if fixed else Path(".")


def _until_glob(parts: tuple[str, ...]) -> list[str]:
    out = []
    for p in parts:
        if any(ch in p for ch in "*?["):
            break
        out.append(p)
    return out
