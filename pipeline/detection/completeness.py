"""Is a checkpoint complete? The facts of its files, judged by the layout table, then stability.

"Size stopped changing" is never enough (docs/design.md, section 2): each file is read for
what it says about itself (pipeline.detection.formats), and the entry is judged by the layout
its writer leaves (pipeline.core.layouts). Only a file without any structure to check (a
legacy pickle, an unknown format) waits for the root's quiet period. Everything is bounded:
nesting depth, file count, name encoding; an entry that can never be read as a checkpoint
raises :class:`~pipeline.errors.UnreadableEntry`, which the watcher reports once and skips.
"""
from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.header import Header
from pipeline.core.layouts import Entry, FileFacts, Verdict, judge
from pipeline.detection.formats import file_facts, read_header
from pipeline.errors import IncompleteCheckpoint, UnreadableEntry

__all__ = ["FileEntry", "Examined", "accept", "examine", "inspect", "list_files", "read_header", "settled",
           "too_costly", "tree_mtime_ns", "unchanged"]

#: A checkpoint folder nested deeper than this is refused (real writers use one or two levels).
MAX_DEPTH = 32
#: A checkpoint folder with more files than this is refused (a 1024-rank DCP step has ~1,000).
MAX_FILES = 200_000
#: Paths longer than this cannot be recorded.
MAX_PATH = 4000
#: A file smaller than this is never judged sparse: hashing it costs little whatever it holds.
SPARSE_FLOOR = 1024 * 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    relpath: str  # "" for a single-file checkpoint
    abspath: str
    size: int
    mtime_ns: int
    header: Header | None  # parsed safetensors header, None for other files
    facts: FileFacts | None = None
    #: bytes the filesystem holds for it (st_blocks * 512); -1 when unknown
    allocated: int = -1

    @property
    def format(self) -> str:
        """How the file is sharded: "safetensors" (at tensor boundaries) or "opaque" (byte chunks)."""
        return "safetensors" if self.header is not None else "opaque"


def check_name(path: str) -> None:
    """Raise :class:`UnreadableEntry` for a path the control plane cannot record."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise UnreadableEntry(shown, "its name is not valid UTF-8; rename it to protect it") from None
    if len(path) > MAX_PATH:
        raise UnreadableEntry(path[:200] + "...", f"its path is longer than {MAX_PATH} characters")


def _walk(path: Path) -> tuple[list[tuple[str, str]], int, list[str]]:
    """``([(relpath, abspath)], newest directory mtime, [relpath of each symlink])`` of a
    folder: regular files only, no symlinks followed, iteratively (a deep tree cannot exhaust
    the stack), within the bounds."""
    out: list[tuple[str, str]] = []
    links: list[str] = []
    newest = 0
    stack: list[tuple[str, int]] = [(str(path), 0)]
    while stack:
        directory, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise UnreadableEntry(str(path), f"it is nested deeper than {MAX_DEPTH} directories")
        try:
            newest = max(newest, os.stat(directory).st_mtime_ns)
            with os.scandir(directory) as it:
                items = sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            continue
        subdirs = []
        for e in items:
            check_name(e.path)
            if e.is_symlink():
                links.append(os.path.relpath(e.path, path))
                continue  # never followed: a link may point anywhere
            if e.is_dir(follow_symlinks=False):
                subdirs.append((e.path, depth + 1))
            elif e.is_file(follow_symlinks=False):
                out.append((os.path.relpath(e.path, path), e.path))
                if len(out) > MAX_FILES:
                    raise UnreadableEntry(str(path), f"it holds more than {MAX_FILES:,} files")
        stack.extend(reversed(subdirs))
    out.sort()
    return out, newest, sorted(links)


def list_files(path: Path) -> list[tuple[str, str]]:
    """``(relpath, abspath)`` of every regular file of a checkpoint, sorted."""
    check_name(str(path))
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return [("", str(path))]
    if not stat.S_ISDIR(st.st_mode):
        return []
    return _walk(path)[0]


@dataclass(frozen=True)
class Examined:
    """A checkpoint entry's files and the layout table's verdict on them."""

    path: Path
    entries: tuple[FileEntry, ...]
    verdict: Verdict
    #: Newest change of any file or directory in it (ns): what the settle and quiet windows measure.
    newest_ns: int
    commit_marker: str = ""
    #: Symlinks inside the folder: never followed, so not part of the checkpoint (reported).
    links: tuple[str, ...] = ()


def examine(path: Path, *, commit_marker: str = "", follow_link: bool = False) -> Examined:
    """Read every file of the entry at ``path`` and judge it (never follows a symlink inside
    it; ``path`` itself only with ``follow_link``, for a link pipeline.detection.roots found
    to stay inside its root).

    Raises :class:`UnreadableEntry` for an entry that cannot be a checkpoint as it is, and
    ``OSError`` when it vanished or changed while being read.
    """
    check_name(str(path))
    st = os.stat(path) if follow_link else os.lstat(path)
    is_dir = stat.S_ISDIR(st.st_mode)
    links: list[str] = []
    if is_dir:
        files, newest, links = _walk(path)
    elif stat.S_ISREG(st.st_mode):
        files, newest = [("", str(path))], 0
    else:
        raise UnreadableEntry(str(path), "it is neither a regular file nor a directory")
    entries = []
    for rel, full in files:
        fst = os.stat(full)
        facts, header = file_facts(rel, full, fst.st_size, fst.st_mtime_ns)
        entries.append(FileEntry(rel, full, fst.st_size, fst.st_mtime_ns, header, facts, fst.st_blocks * 512))
        newest = max(newest, fst.st_mtime_ns)
    verdict = judge(Entry(path.name, is_dir, tuple(e.facts for e in entries if e.facts is not None),
                          commit_marker=commit_marker if is_dir else ""))
    return Examined(path, tuple(entries), verdict, newest, commit_marker if is_dir else "", tuple(links))


def inspect(path: Path, *, commit_marker: str = "", quiet_seconds: float | None = None, declared: bool = False,
            now: float | None = None) -> list[FileEntry]:
    """The files of a complete checkpoint; raises :class:`IncompleteCheckpoint` otherwise.

    A "quiet" verdict (files without structure) counts as complete once nothing changed for
    ``quiet_seconds`` (None: never, the caller waits elsewhere). ``declared``: the writer said
    the checkpoint is complete (``pipeline.protect``): the rules about the writer's order
    (its last file, a marker) and the quiet period are not needed, but the files an index or
    a DCP .metadata names must be there, and a file broken by its own structure (a truncated
    safetensors file, a zip without its end record) is still refused.
    """
    if not os.path.lexists(path):
        raise IncompleteCheckpoint(str(path), "it does not exist")
    return accept(examine(path, commit_marker=commit_marker), quiet_seconds=quiet_seconds, declared=declared,
                  now=now)


def accept(found: Examined, *, quiet_seconds: float | None = None, declared: bool = False,
           now: float | None = None) -> list[FileEntry]:
    """The files of an examined entry if it is complete (see :func:`inspect`)."""
    path, v = found.path, found.verdict
    if declared and v.kind in ("incomplete", "quiet"):
        facts = tuple(e.facts for e in found.entries if e.facts is not None)
        v = judge(Entry(path.name, path.is_dir(), facts, commit_marker=found.commit_marker), declared=True)
    if v.complete:
        return list(found.entries)
    if v.kind == "quiet" and quiet_seconds is not None:
        age = (time.time() if now is None else now) - found.newest_ns / 1e9
        if age >= quiet_seconds:
            return list(found.entries)
        raise IncompleteCheckpoint(str(path), f"{v.reason} (quiet for {age:.0f} of {quiet_seconds:.0f} s)")
    raise IncompleteCheckpoint(str(path), v.reason)


def too_costly(entries: list[FileEntry] | tuple[FileEntry, ...], *, max_bytes: int, sparse_ratio: float) -> str | None:
    """Why hashing these files is not detection's work (None if it is): a file larger than
    ``max_bytes`` (0: no limit), or one of at least :data:`SPARSE_FLOOR` bytes of which the
    filesystem holds less than ``sparse_ratio`` (a ``truncate -s 100T`` file would be read
    as 100 TB of zeros; 0: never judged). Reported, with the setting that lets it through."""
    for e in entries:
        name = e.relpath or os.path.basename(e.abspath)
        if sparse_ratio and e.size >= SPARSE_FLOOR and 0 <= e.allocated < e.size * sparse_ratio:
            return (f"{name} is a sparse file: {e.size:,} bytes of which the disk holds {e.allocated:,}"
                    f" (less than sparse_ratio {sparse_ratio:g}): it is not hashed; set CKPT_SPARSE_RATIO=0"
                    " to protect it anyway")
        if max_bytes and e.size > max_bytes:
            return (f"{name} is {e.size:,} bytes, more than max_hash_bytes ({max_bytes:,}): it is not hashed;"
                    f" set CKPT_MAX_HASH_BYTES above {e.size:,} (or 0) to protect it")
    return None


def total_size(entries: Iterable[FileEntry]) -> int:
    """The bytes hashing ``entries`` reads."""
    return sum(e.size for e in entries)


def tree_mtime_ns(path: Path) -> int:
    """Newest mtime of a checkpoint directory and its subdirectories (0 for a file).

    Adding or removing an entry changes its directory's mtime, not the files': a
    directory being deleted can look like a smaller, valid checkpoint for a moment.
    """
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):  # a symlinked checkpoint: its target's tree
            return 0
        return _walk(path)[1]
    except (FileNotFoundError, UnreadableEntry):
        return 0


def settled(entries: list[FileEntry] | tuple[FileEntry, ...], settle_seconds: float, now: float | None = None,
            tree_ns: int = 0) -> bool:
    """True when no file (and no directory entry) changed during the last ``settle_seconds``."""
    now = time.time() if now is None else now
    newest = max(max(e.mtime_ns for e in entries), tree_ns) / 1e9
    return now - newest >= settle_seconds


def unchanged(entries: list[FileEntry] | tuple[FileEntry, ...]) -> bool:
    """True when every file still has the size and mtime recorded in ``entries``."""
    for e in entries:
        try:
            st = os.stat(e.abspath)
        except FileNotFoundError:
            return False
        if st.st_size != e.size or st.st_mtime_ns != e.mtime_ns:
            return False
    return True
