"""Where a content's bytes come from for an upload: a shard of a local checkpoint file.

A shard's bytes are its own safetensors header (rebuilt from the source file's header) then
a byte range of the file. Any checkpoint that still has its local copy and references the
content can be the source; the one whose store needs it is preferred.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline.core.header import Header, shard_header
from pipeline.db.models import Checkpoint, CheckpointFile, Job, Shard
from pipeline.detection.catalog import file_on_host, file_path
from pipeline.detection.completeness import read_header
from pipeline.states import JobKind, StoreState


@dataclass(frozen=True)
class Source:
    """A shard of a local file that holds a content's bytes."""

    path: str
    kind: str
    tensors: tuple[str, ...]
    offset: int
    length: int
    checkpoint_id: int | None  # None: named by detection before the checkpoint was recorded
    job_id: int | None  # the store job of that checkpoint, when it is the one that needs the bytes


def named_source(named: dict[str, Any] | None) -> Source | None:
    """The shard a message names (an upload detection started while hashing:
    pipeline.store.early), if its file still has the size and mtime it was hashed with."""
    if not named:
        return None
    try:
        st = os.stat(named["path"])
    except OSError:
        return None
    if (st.st_size, st.st_mtime_ns) != (named["size"], named["mtime_ns"]):
        return None
    return Source(named["path"], named["kind"], tuple(named["tensors"]), named["offset"], named["length"], None, None)


def local_source(session: Session, sha: str, host: str | None) -> Source | None:
    """A local file shard with content ``sha`` on ``host`` (this process's: docs/design.md,
    "Hosts"; a part it holds of another host's checkpoint counts): of a checkpoint whose store
    is sending it first, else of any checkpoint that still has its local copy there."""
    rows = session.execute(
        select(Shard, CheckpointFile, Checkpoint)
        .join(CheckpointFile, CheckpointFile.id == Shard.file_id)
        .join(Checkpoint, Checkpoint.id == CheckpointFile.checkpoint_id)
        .where(Shard.sha256 == sha, Checkpoint.local_present.is_(True), file_on_host(host))
        .order_by(Checkpoint.id.desc())
    ).all()
    best: Source | None = None
    for shard, f, ckpt in rows:
        job = session.scalar(select(Job).where(Job.checkpoint_id == ckpt.id, Job.kind == JobKind.STORE)
                             .order_by(Job.id.desc()).limit(1))
        src = Source(file_path(ckpt, f), shard.kind, tuple(shard.tensors or ()), shard.src_offset, shard.length,
                     ckpt.id, job.id if job is not None else None)
        if job is not None and job.state == StoreState.SHARDED:
            return src
        best = best or src
    return best


def holding_hosts(session: Session, sha: str) -> list[str | None]:
    """The hosts whose disk holds a local file with content ``sha`` (the checkpoint's host, or
    the part's for a file another host holds), each once: the one whose store is sending it
    first, then by newest checkpoint. None: a checkpoint recorded before hosts (any host's)."""
    rows = session.execute(
        select(func.coalesce(CheckpointFile.host, Checkpoint.host), Job.state).select_from(Checkpoint)
        .join(CheckpointFile, CheckpointFile.checkpoint_id == Checkpoint.id)
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .outerjoin(Job, (Job.checkpoint_id == Checkpoint.id) & (Job.kind == JobKind.STORE))
        .where(Shard.sha256 == sha, Checkpoint.local_present.is_(True))
        .order_by(Checkpoint.id.desc(), Job.id.desc())
    ).all()
    sending = [host for host, state in rows if state == StoreState.SHARDED]
    return list(dict.fromkeys([*sending, *(host for host, _state in rows)]))


@functools.lru_cache(maxsize=64)
def _header_of(path: str, size: int, mtime_ns: int) -> Header:
    return read_header(path)


def shard_prefix(path: str, kind: str, tensors: tuple[str, ...] | list[str]) -> bytes:
    """The bytes a shard has before its payload: its own safetensors header (b"" for raw).

    Rebuilt from the source file's header, parsed once per file version (path, size and
    mtime) in this process rather than once per replica. Deterministic: the same bytes the
    planner hashed.
    """
    if kind != "safetensors":
        return b""
    st = os.stat(path)
    names = set(tensors)
    return shard_header([t for t in _header_of(path, st.st_size, st.st_mtime_ns).tensors if t.name in names])


def source_matches(src: str, kind: str, tensors: tuple[str, ...], offset: int, length: int, sha: str) -> bool:
    """Whether the shard's bytes in the source file still hash to ``sha`` (a worker that
    refused them got them damaged on the way, or the source changed: this tells which)."""
    try:
        h = hashlib.sha256(shard_prefix(src, kind, tensors))
        with open(src, "rb") as f:
            f.seek(offset)
            remaining = length
            while remaining and (chunk := f.read(min(remaining, 4 << 20))):
                h.update(chunk)
                remaining -= len(chunk)
        return not remaining and h.hexdigest() == sha
    except (OSError, ValueError):
        return False
