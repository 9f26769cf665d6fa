"""Is a checkpoint complete? Structural checks, then stability (docs/design.md, section 2).

"Size stopped changing" is never enough: every safetensors file must parse with a
length that matches its header, a directory's known markers must be present (``.metadata``
for torch DCP, every shard of an HF index, ``trainer_state.json`` for HF Trainer), and
nothing may have changed for the settle window.
"""
from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.header import MAX_HEADER_BYTES, Header, parse_header
from pipeline.errors import HeaderError, IncompleteCheckpoint

#: Written by the HF Trainer with the model, first thing in ``checkpoint-N/``; the Trainer
#: writes ``trainer_state.json`` last. Plain ``optimizer.pt`` is not a sign: many trainers
#: write one without any trainer state.
HF_TRAINER_FILES = ("training_args.bin",)


@dataclass(frozen=True)
class FileEntry:
    relpath: str  # "" for a single-file checkpoint
    abspath: str
    size: int
    mtime_ns: int
    header: Header | None  # parsed safetensors header, None for opaque files

    @property
    def format(self) -> str:
        return "safetensors" if self.header is not None else "opaque"


def list_files(path: Path) -> list[tuple[str, str]]:
    """``(relpath, abspath)`` of every regular file of a checkpoint, sorted."""
    if path.is_file():
        return [("", str(path))]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append((os.path.relpath(full, path), full))
    return out


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at ``path``."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) < 8:
            raise HeaderError(p, f"file has {size} bytes, fewer than the 8-byte header length")
        (n,) = struct.unpack("<Q", first)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            return parse_header(first, size, p)  # raises with the precise reason
        return parse_header(first + f.read(n), size, p)


def inspect(path: Path) -> list[FileEntry]:
    """Validate a checkpoint's structure; return its files.

    Raises :class:`~pipeline.errors.IncompleteCheckpoint` (markers missing, empty) or
    :class:`~pipeline.errors.HeaderError` (a safetensors file that is malformed or truncated).
    """
    if not path.exists():
        raise IncompleteCheckpoint(str(path), "it does not exist")
    files = list_files(path)
    if not files:
        raise IncompleteCheckpoint(str(path), "the directory is empty")
    entries = []
    for rel, full in files:
        st = os.stat(full)
        header = read_header(full) if full.endswith(".safetensors") else None
        entries.append(FileEntry(rel, full, st.st_size, st.st_mtime_ns, header))
    if path.is_dir():
        _check_markers(path, {e.relpath for e in entries})
    return entries


def _check_markers(path: Path, rels: set[str]) -> None:
    names = {os.path.basename(r) for r in rels}
    if any(r.endswith(".distcp") for r in rels) and ".metadata" not in names:
        raise IncompleteCheckpoint(str(path), "torch DCP shards (*.distcp) without the .metadata file")
    for rel in sorted(r for r in rels if r.endswith(".index.json")):
        try:
            index = json.loads((path / rel).read_text())
            weight_map = index["weight_map"]
            needed = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IncompleteCheckpoint(str(path), f"{rel} is not a readable HF index ({exc})") from None
        base = os.path.dirname(rel)
        missing = sorted(n for n in needed if os.path.join(base, n) not in rels)
        if missing:
            raise IncompleteCheckpoint(str(path), f"{rel} names missing files: {', '.join(missing[:5])}")
    if any(n in names for n in HF_TRAINER_FILES) and "trainer_state.json" not in names:
        raise IncompleteCheckpoint(str(path), "HF Trainer checkpoint without trainer_state.json")


def tree_mtime_ns(path: Path) -> int:
    """Newest mtime of a checkpoint directory and its subdirectories (0 for a file).

    Adding or removing an entry changes its directory's mtime, not the files': a
    directory being deleted can look like a smaller, valid checkpoint for a moment.
    """
    if not path.is_dir():
        return 0
    newest = 0
    for dirpath, _dirs, _files in os.walk(path):
        try:
            newest = max(newest, os.stat(dirpath).st_mtime_ns)
        except FileNotFoundError:
            pass
    return newest


def settled(entries: list[FileEntry], settle_seconds: float, now: float | None = None,
            tree_ns: int = 0) -> bool:
    """True when no file (and no directory entry) changed during the last ``settle_seconds``."""
    now = time.time() if now is None else now
    newest = max(max(e.mtime_ns for e in entries), tree_ns) / 1e9
    return now - newest >= settle_seconds


def unchanged(entries: list[FileEntry]) -> bool:
    """True when every file still has the size and mtime recorded in ``entries``."""
    for e in entries:
        try:
            st = os.stat(e.abspath)
        except FileNotFoundError:
            return False
        if st.st_size != e.size or st.st_mtime_ns != e.mtime_ns:
            return False
    return True

