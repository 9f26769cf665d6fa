"""Where a restore may write, and what ``--overwrite`` may replace (docs/design.md, invariant 7).

A restore destination is confined to the restore roots: the watched roots themselves (a glob
root's fixed part before its first glob component) and the directories of
``CKPT_RESTORE_ROOTS``; a request from the CLI or the Python API adds the caller's current
directory (the web API does not: its caller has none on this host). It is never inside or
above the control plane's home (the database, keys and worker data live there), and never
onto, into or above a checkpoint that is not yet protected.

An existing destination is replaced (``overwrite``) only when it is a protected checkpoint's
restorable content: every byte in it is kept by the workers, so replacing it loses nothing.
That is :func:`refuse_overwrite` (what the database says: never a root, a run, a path that
holds checkpoints or another host's part) and then :func:`examine` (what the disk says: files
unchanged from a protected version at that path, or files that all hash as a protected
checkpoint's, none written within the settle time). The restore actor checks both again in
the transaction that decides to write (pipeline/restoring/job.py).
"""
from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db.models import Checkpoint, CheckpointFile, CheckpointPart
from pipeline.detection import roots as roots_mod
from pipeline.errors import DestinationExists, UnsafeDestination
from pipeline.settings import Settings

#: Said after every refusal of an overwrite: what the person can do instead.
INSTEAD = "restore to a new path instead"
#: Opens a short session (``lambda: session_scope(url, readonly=True)``).
SessionFactory = Callable[[], AbstractContextManager[Session]]


def restore_roots(settings: Settings, extra: Iterable[Path] = ()) -> list[Path]:
    """The directories a restore may write under, resolved: the watched roots' fixed parts,
    ``settings.restore_roots`` and ``extra`` (the caller's current directory)."""
    roots = [fixed_prefix(r) for r in settings.roots]
    roots += [Path(r).expanduser() for r in settings.restore_roots]
    return list(dict.fromkeys(p.resolve() for p in (*roots, *extra)))


def check(session: Session, settings: Settings, target: Path, extra_roots: Iterable[Path] = ()) -> None:
    """Raise :class:`UnsafeDestination` unless ``target`` (resolved) may be written by a restore."""
    roots = restore_roots(settings, extra_roots)
    if not any(_within(target, r) for r in roots):
        shown = ", ".join(str(r) for r in roots) or "none: no watched roots and no CKPT_RESTORE_ROOTS"
        raise UnsafeDestination(f"{target} is outside the restore roots ({shown}); restore under one of them, "
                                "or add a directory to CKPT_RESTORE_ROOTS")
    home = settings.home.resolve()
    if _within(target, home) or _within(home, target):
        raise UnsafeDestination(f"{target} is inside or above the control plane's home {home}; choose another place")
    unsafe = session.scalar(
        select(Checkpoint.path).where(
            Checkpoint.current.is_(True), Checkpoint.local_present.is_(True),
            Checkpoint.store_state.not_in(sorted(states.PROTECTED)),
            or_(Checkpoint.path == str(target), Checkpoint.path.startswith(f"{target}/", autoescape=True),
                *(Checkpoint.path == str(p) for p in target.parents)))
        .limit(1))
    if unsafe is not None:
        raise UnsafeDestination(f"{target} would overwrite {unsafe}, a checkpoint that is not protected yet (its only "
                                "copy is that local one); restore somewhere else")


def existing(session: Session, settings: Settings, target: Path, *, overwrite: bool,
             extra_roots: Iterable[Path] = ()) -> bool:
    """Whether ``target`` exists (then it must be examined before it is replaced); raise
    :class:`DestinationExists` if it does and ``overwrite`` was not asked for, and
    :class:`UnsafeDestination` if it is something an overwrite never removes."""
    if not os.path.lexists(target):
        return False
    if not overwrite:
        raise DestinationExists(str(target))
    refuse_overwrite(session, settings, target, extra_roots)
    return True


def refuse_overwrite(session: Session, settings: Settings, target: Path, extra_roots: Iterable[Path] = ()) -> None:
    """Raise :class:`UnsafeDestination` if the existing ``target`` is something an overwrite must
    never remove, by what the roots and the database say: a watched or restore root (or a
    directory above one), a run, a directory holding checkpoints, a path inside a
    checkpoint, a part of a checkpoint that several hosts write."""
    for root in (*(fixed_prefix(r).resolve() for r in settings.roots), *restore_roots(settings, extra_roots)):
        if _within(root, target):
            raise UnsafeDestination(f"{target} is {'a' if root == target else 'above the'} restore root {root}: "
                                    f"an overwrite never removes a root; {INSTEAD}")
    for run in roots_mod.runs(settings.roots):
        if _within(run, target):
            raise UnsafeDestination(f"{target} {'is' if run == target else 'holds'} the run {run}: an overwrite never "
                                    f"removes a run; {INSTEAD}")
    t, under = str(target), f"{target}/"
    run = session.scalar(select(Checkpoint.run).where(or_(Checkpoint.run == t, Checkpoint.run.startswith(
        under, autoescape=True))).limit(1))
    if run is not None:
        raise UnsafeDestination(f"{target} holds the run {run}: an overwrite never removes a run; {INSTEAD}")
    inner = session.scalar(select(Checkpoint.path).where(Checkpoint.path.startswith(under, autoescape=True)).limit(1))
    if inner is not None:
        raise UnsafeDestination(f"{target} holds the checkpoint {inner}: an overwrite never removes a directory that "
                                f"holds checkpoints; {INSTEAD}")
    outer = session.scalar(select(Checkpoint.path).where(
        Checkpoint.path.in_([str(p) for p in target.parents])).limit(1))
    if outer is not None:
        raise UnsafeDestination(f"{target} is inside the checkpoint {outer}: an overwrite replaces a whole checkpoint "
                                f"or nothing; {INSTEAD}")
    part = session.execute(select(CheckpointPart.host, CheckpointPart.path).where(or_(
        CheckpointPart.path == t, CheckpointPart.path.startswith(under, autoescape=True),
        CheckpointPart.path.in_([str(p) for p in target.parents]))).limit(1)).first()
    if part is not None:
        raise UnsafeDestination(f"{target} holds files of {part.path} that host {part.host} writes (a part of a "
                                f"checkpoint saved from several hosts): an overwrite never removes them; {INSTEAD}")


@dataclass(frozen=True)
class Entry:
    """One file of an existing destination as it was examined."""

    relpath: str
    size: int
    sha256: str
    mtime_ns: int
    ino: int


@dataclass(frozen=True)
class Replaceable:
    """An existing destination found to be a protected checkpoint's restorable content: what
    it matched and its files as they were then (:func:`unchanged` compares them again)."""

    target: str
    is_dir: bool
    entries: tuple[Entry, ...]
    matched: str

    def stats(self) -> set[tuple[str, int, int, int]]:
        return {(e.relpath, e.size, e.mtime_ns, e.ino) for e in self.entries}


def examine(session_factory: SessionFactory, settings: Settings, target: Path, *, trust_stat: bool) -> Replaceable:
    """Whether the existing ``target`` is a protected checkpoint's restorable content; raise
    :class:`UnsafeDestination` (with the reason) if it is not.

    Reads the files with no transaction open, then matches them in a short read.
    ``trust_stat``: a file whose size and mtime equal a protected version's record at this
    path counts as unchanged without being read (what a form's check uses); the restore
    actor hashes every byte.
    """
    is_dir = stat.S_ISDIR(os.lstat(target).st_mode)
    with session_factory() as s:
        known = _recorded_here(s, settings, target)
    listed = _walk(target, settle_seconds=settings.settle_seconds)
    entries = tuple(_hashed(target, rel, st, known if trust_stat else {}, is_dir) for rel, st in listed)
    if not entries:
        raise UnsafeDestination(f"{target} holds no file of a protected checkpoint (it is empty); remove it yourself "
                                f"or {INSTEAD}")
    with session_factory() as s:
        matched = _match(s, settings, target, entries, is_dir)
    if matched is None:
        raise UnsafeDestination(f"{target} is not a protected checkpoint's content (its files are not those of a "
                                f"verified version: changed on disk, still being written, or never protected); an "
                                f"overwrite would lose them; {INSTEAD}")
    return Replaceable(str(target), is_dir, entries, matched)


def unchanged(found: Replaceable, target: Path | None = None) -> None:
    """Raise :class:`UnsafeDestination` unless the files at ``target`` (default: where ``found``
    was examined) are still those ``found`` hashed (size, mtime, inode): the check the
    deciding transaction makes, without reading the bytes again."""
    where = target or Path(found.target)
    try:
        now = {(rel, st.st_size, st.st_mtime_ns, st.st_ino) for rel, st in _walk(where, settle_seconds=0)}
    except FileNotFoundError:
        now = set()
    if now != found.stats():
        raise UnsafeDestination(f"{found.target} changed while the restore ran (files written, added or removed since "
                                f"it was found to be a protected checkpoint's content); left it as it is; {INSTEAD}")


def _recorded_here(session: Session, settings: Settings, target: Path) -> dict[str, tuple[int, int, str]]:
    """relpath -> (size, mtime_ns, sha256) of the files of the protected versions recorded at
    ``target`` on this host (of a version whose files are all this host's)."""
    rows = session.execute(
        select(CheckpointFile.relpath, CheckpointFile.size, CheckpointFile.mtime_ns, CheckpointFile.sha256,
               CheckpointFile.host)
        .join(Checkpoint, Checkpoint.id == CheckpointFile.checkpoint_id)
        .where(Checkpoint.path == str(target), or_(Checkpoint.host == settings.host_id, Checkpoint.host.is_(None)),
               Checkpoint.store_state.in_(sorted(states.PROTECTED)))).all()
    return {r.relpath: (r.size, r.mtime_ns, r.sha256) for r in rows if r.host in (None, settings.host_id)}


def _match(session: Session, settings: Settings, target: Path, entries: tuple[Entry, ...], is_dir: bool) -> str | None:
    """A description of the protected checkpoint whose files these are, or None.

    Either a protected version recorded at ``target`` on this host whose files are exactly
    these, or any protected checkpoint holding every one of these files (a directory: at the
    same relative paths; a file: any of its files)."""
    have = {(e.relpath, e.size, e.sha256) for e in entries}
    here = session.execute(
        select(Checkpoint.id, CheckpointFile.relpath, CheckpointFile.size, CheckpointFile.sha256,
               CheckpointFile.host)
        .join(CheckpointFile, Checkpoint.id == CheckpointFile.checkpoint_id)
        .where(Checkpoint.path == str(target), or_(Checkpoint.host == settings.host_id, Checkpoint.host.is_(None)),
               Checkpoint.store_state.in_(sorted(states.PROTECTED)))).all()
    versions: dict[int, set[tuple[str, int, str]]] = {}
    for r in here:
        if r.host not in (None, settings.host_id):
            versions[r.id] = {("", -1, "another host's")}  # several hosts: never equal to a local tree
        else:
            versions.setdefault(r.id, set()).add((r.relpath, r.size, r.sha256))
    for cid, files in versions.items():
        if files == have:
            return f"checkpoint {cid}, unchanged on disk"
    shared = session.execute(
        select(Checkpoint.id, CheckpointFile.relpath, CheckpointFile.size, CheckpointFile.sha256)
        .join(CheckpointFile, Checkpoint.id == CheckpointFile.checkpoint_id)
        .where(CheckpointFile.sha256.in_(sorted({e.sha256 for e in entries})),
               Checkpoint.store_state.in_(sorted(states.PROTECTED)))).all()
    if not is_dir:
        e = entries[0]
        hit = next((row.id for row in shared if (row.size, row.sha256) == (e.size, e.sha256)), None)
        return None if hit is None else f"a file of checkpoint {hit}"
    holding: dict[int, set[tuple[str, int, str]]] = {}
    for row in shared:
        holding.setdefault(row.id, set()).add((row.relpath, row.size, row.sha256))
    hit = next((cid for cid, files in holding.items() if have <= files), None)
    return None if hit is None else f"files of checkpoint {hit}"


def seen(target: Path) -> list[list[object]] | None:
    """What is at ``target`` now, as a restore request saw it: per file (relpath, size,
    mtime_ns, inode); None if nothing is there. The actor refuses when this changed since the
    request (a trainer saved there again meanwhile: its new save is not what was asked to be
    replaced)."""
    if not os.path.lexists(target):
        return None
    try:
        return [[rel, st.st_size, st.st_mtime_ns, st.st_ino] for rel, st in walk(target)]
    except UnsafeDestination:
        return [["?", 0, 0, 0]]  # refused anyway by the overwrite rules


def walk(target: Path) -> list[tuple[str, os.stat_result]]:
    """(relpath, lstat) of every file under ``target`` ("" for a file); raise for a link or
    a special file in it (a restore's own output never holds one)."""
    return _walk(target, settle_seconds=0)


def _walk(target: Path, *, settle_seconds: float) -> list[tuple[str, os.stat_result]]:
    """(relpath, lstat) of every file under ``target`` ("" for a file), never following a
    link; raise for a link, a special file, or an entry written within ``settle_seconds``."""
    out: list[tuple[str, os.stat_result]] = []
    newest = time.time() - settle_seconds

    def visit(path: Path, rel: str) -> None:
        st = os.lstat(path)
        if settle_seconds and st.st_mtime > newest:
            age = max(0.0, time.time() - st.st_mtime)
            raise UnsafeDestination(f"{path} was written {age:.1f} s ago: it may still be being written, and an "
                                    f"overwrite would lose it; {INSTEAD}")
        if stat.S_ISDIR(st.st_mode):
            for name in sorted(os.listdir(path)):
                visit(path / name, f"{rel}/{name}" if rel else name)
        elif stat.S_ISREG(st.st_mode):
            out.append((rel, st))
        else:
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a special file"
            raise UnsafeDestination(f"{path} is {kind}: not a checkpoint's content, an overwrite never removes "
                                    f"it; {INSTEAD}")

    visit(target, "")
    return out


def _hashed(target: Path, rel: str, st: os.stat_result, known: Mapping[str, tuple[int, int, str]],
            is_dir: bool) -> Entry:
    record = known.get(rel)
    if record is not None and record[:2] == (st.st_size, st.st_mtime_ns):
        return Entry(rel, st.st_size, record[2], st.st_mtime_ns, st.st_ino)
    fd = os.open(target / rel if is_dir else target, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return Entry(rel, st.st_size, digest, st.st_mtime_ns, st.st_ino)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def fixed_prefix(root: str) -> Path:
    """The part of a watched root before its first glob component (``/data/*/runs/*`` -> ``/data``)."""
    parts = Path(root).expanduser().parts
    fixed = _until_glob(parts)
    return Path(*fixed) if fixed else Path(".")


def _until_glob(parts: tuple[str, ...]) -> list[str]:
    out = []
    for p in parts:
        if any(ch in p for ch in "*?["):
            break
        out.append(p)
    return out
