"""The current version of a path is what is on disk now (docs/design.md, section 2).

A recorded checkpoint's files can change under it: a trainer saving again into the same
folder (a restart that redoes a step), a save killed halfway through that, a file edited in
place. Until the new content is complete and recorded, the path holds bytes no version
describes. The watcher of the checkpoint's host then flags the checkpoint (:func:`flag`):
``ckpt status``, the UI and ``/metrics`` say "changed on disk, not protected", and a restore
*by path* refuses (pipeline.restoring.current) instead of silently giving back older weights.
Recording the new content, or the recorded content coming back, clears the flag.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.orm import Session

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import now

log = logging.getLogger("ckpt.detect")

Signature = tuple[tuple[str, int, int], ...]


class Recorded(Protocol):
    """A recorded file, as :func:`differs` reads it (a ``CheckpointFile``, or a copy of one
    kept past its session)."""

    @property
    def relpath(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def mtime_ns(self) -> int: ...
    @property
    def sha256(self) -> str: ...


def differs(root: Path, is_dir: bool, files: Sequence[Recorded], *, by_content: bool = False) -> str | None:
    """What of the files at ``root`` differs from the recorded ``files`` (relative path,
    size, modification time): a file rewritten in place or added since holds bytes no
    replica has. A file gone is not counted (nothing of it is left to lose). None if nothing.
    ``by_content``: a file of the recorded size whose time moved (touched, copied back) is
    hashed, and differs only if its SHA-256 does."""
    recorded = {f.relpath: f for f in files}
    if is_dir and root.is_dir():
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if rel not in recorded and not os.path.islink(full):  # a link is never part of it (detection)
                    return f"{rel} was added to {root} after it was stored"
    for rel, f in recorded.items():
        path = root / rel if rel else root
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue  # gone already: nothing of it left to lose
        except OSError as exc:  # a folder replaced by a file, a link loop, no permission to look
            return f"{path} cannot be read as it was stored ({exc.strerror or exc})"
        if (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
            if by_content and st.st_size == f.size and _sha256(path) == f.sha256:
                continue
            return f"{path} changed after it was stored ({st.st_size:,} bytes, modified {st.st_mtime_ns})"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def changed_files(recorded: Signature, found: Signature) -> list[str]:
    """Relative paths that differ between two signatures (changed, added or gone)."""
    a = {rel: (size, ns) for rel, size, ns in recorded}
    b = {rel: (size, ns) for rel, size, ns in found}
    return sorted(rel for rel in a.keys() | b.keys() if a.get(rel) != b.get(rel))


def flag(session: Session, path: str, host: str | None, why: str) -> None:
    """Flag the current version at ``path`` on ``host``: its files on disk are not it."""
    session.execute(update(Checkpoint).where(
        Checkpoint.path == path, Checkpoint.current.is_(True), _host(host), Checkpoint.disk_changed_at.is_(None))
        .values(disk_changed_at=now(), disk_changed=why))
    session.execute(update(Checkpoint).where(
        Checkpoint.path == path, Checkpoint.current.is_(True), _host(host),
        Checkpoint.disk_changed.is_distinct_from(why)).values(disk_changed=why))


def clear(session: Session, path: str, host: str | None) -> None:
    """The files at ``path`` are a recorded version again (or gone): no flag on any version."""
    session.execute(update(Checkpoint).where(Checkpoint.path == path, _host(host),
                                             Checkpoint.disk_changed_at.is_not(None))
                    .values(disk_changed_at=None, disk_changed=None))


def _host(host: str | None) -> ColumnElement[bool]:
    return Checkpoint.host.is_(None) if host is None else Checkpoint.host == host


class DiskChanges:
    """The watcher's view of which paths it flagged: the database is written only when a
    path's state changes, not on every scan."""

    def __init__(self, db_url: str, host: str | None) -> None:
        self.db_url, self.host = db_url, host
        self.flagged: dict[str, str] = {}

    def load(self, session: Session) -> None:
        """At the watcher's start: what this host flagged before."""
        q = select(Checkpoint.path, Checkpoint.disk_changed).where(
            Checkpoint.disk_changed_at.is_not(None), Checkpoint.current.is_(True), _host(self.host))
        self.flagged = {path: why or "" for path, why in session.execute(q)}

    def seen(self, path: str, why: str | None) -> None:
        """``why``: what on disk differs from the recorded version at ``path`` (None: nothing)."""
        if self.flagged.get(path) == why or (why is None and path not in self.flagged):
            return
        with session_scope(self.db_url) as s:
            if why is None:
                clear(s, path, self.host)
            else:
                flag(s, path, self.host, why)
        if why is None:
            self.flagged.pop(path, None)
            log.info("%s: the files on disk are the recorded version again", path)
        else:
            self.flagged[path] = why
            log.warning("%s changed on disk and the new content is not protected yet: %s", path, why)

    def forget(self, path: str) -> None:
        self.flagged.pop(path, None)
