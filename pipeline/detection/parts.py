"""One checkpoint, several hosts: the parts other hosts hold (docs/design.md, "One checkpoint,
several hosts").

Multi-node torch DCP writes one step from every node to that node's own disk, at the same
path: each rank's ``.distcp`` files where it runs, ``.metadata`` (written last) on the
coordinator's host. A host whose folder holds rank files without ``.metadata`` announces
them as a part: hashed and planned as detection does any checkpoint, recorded in
``checkpoint_parts``. The coordinator's host records the checkpoint once its own files and
the announced parts together hold every file its ``.metadata`` names, each long enough, and
claims those parts: from then on it is one checkpoint, protected, rotated and restored as one.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.core.layouts import FileFacts, rank_metadata
from pipeline.db.models import Checkpoint, CheckpointPart
from pipeline.db.transitions import now
from pipeline.detection.catalog import Detected, PartFile, latest_store_job, mark_vanished
from pipeline.states import StoreState


def is_part(names: Iterable[str]) -> bool:
    """Whether a folder's files are a DCP rank's part: data files, and no metadata at all (a
    folder with a rank's own ``__<rank>.metadata`` is a save without collectives, judged whole
    on this host by the layout table)."""
    rels = list(names)
    return ".metadata" not in rels and not rank_metadata(rels) and any(r.endswith(".distcp") for r in rels)


def _file_rows(d: Detected) -> list[dict[str, Any]]:
    return [{"relpath": e.relpath, "size": e.size, "mtime_ns": e.mtime_ns, "sha256": sha, "format": e.format,
             "facts_format": e.facts.format if e.facts is not None else "",
             "shards": [{"seq": p.seq, "kind": p.kind, "sha256": shard_sha, "size": p.size,
                         "src_offset": p.src_offset, "length": p.length, "payload_offset": p.payload_offset,
                         "tensors": list(p.tensors) or None} for p, shard_sha in shards]}
            for e, sha, shards in zip(d.entries, d.shas, d.shards, strict=True)]


def announce(session: Session, d: Detected, host: str) -> CheckpointPart:
    """Record (or renew) ``host``'s part at ``d.path``. New bytes there are a new part: any
    claim by an older checkpoint ends (that checkpoint keeps its own file rows)."""
    version = d.version
    part = session.scalar(select(CheckpointPart).where(CheckpointPart.host == host,
                                                       CheckpointPart.path == str(d.path)))
    if part is None:
        part = CheckpointPart(host=host, path=str(d.path), run=str(d.run), files=_file_rows(d), version=version,
                              local_present=True, announced_at=now())
        session.add(part)
    elif part.version != version or not part.local_present:
        part.files, part.version, part.run = _file_rows(d), version, str(d.run)
        part.checkpoint_id, part.local_present, part.announced_at = None, True, now()
    elif _times(part.files) != {e.relpath: e.mtime_ns for e in d.entries}:
        # The same bytes written again (a re-save of the step): still this part, claim kept;
        # its new times say it belongs to the new save too (for_new_save).
        part.files, part.announced_at = _file_rows(d), now()
    session.flush()
    return part


def file_sig(part: CheckpointPart) -> tuple[tuple[str, int, int], ...]:
    """The signature of a part's files as announced: (relpath, size, mtime_ns)."""
    return tuple((f["relpath"], f["size"], f["mtime_ns"]) for f in part.files)


def _times(files: list[dict[str, Any]]) -> dict[str, int]:
    return {f["relpath"]: f["mtime_ns"] for f in files}


def for_new_save(session: Session, offered: list[CheckpointPart], local: Iterable[tuple[str, int, int]]
                 ) -> list[CheckpointPart]:
    """Of the ``offered`` parts, those that may belong to the save whose local files are
    ``local`` (relpath, size, mtime_ns). A part claimed by a recorded version whose own files
    are not these, and not announced again since (its file times are those that version
    recorded), is the old save's: a step saved again at the same path waits for each host's
    new part instead of mixing in a stale one."""
    local = tuple(local)
    out = []
    for part in offered:
        ckpt = session.get(Checkpoint, part.checkpoint_id) if part.checkpoint_id is not None else None
        if ckpt is not None:
            theirs = {f.relpath: f.mtime_ns for f in ckpt.files if f.host == part.host}
            own = tuple(sorted((f.relpath, f.size, f.mtime_ns) for f in ckpt.files if f.host is None))
            if _times(part.files) == theirs and own != tuple(sorted(local)):
                continue
        out.append(part)
    return out


def offered(session: Session, path: str, host: str) -> list[CheckpointPart]:
    """Parts other hosts announced at ``path`` and still hold, newest first."""
    return list(session.scalars(select(CheckpointPart).where(
        CheckpointPart.path == path, CheckpointPart.host != host, CheckpointPart.local_present.is_(True))
        .order_by(CheckpointPart.announced_at.desc(), CheckpointPart.id.desc())))


def covering(parts: list[CheckpointPart], local: Iterable[str]) -> tuple[list[FileFacts], list[PartFile], list[int]]:
    """The files the parts add to the local ones (the newest part wins a name two parts hold):
    their facts for the layout table, the files to record and the part ids they come from."""
    have = set(local)
    facts, files, used = [], [], []
    for part in parts:
        mine = [f for f in part.files if f["relpath"] not in have]
        if not mine:
            continue
        used.append(part.id)
        for f in mine:
            have.add(f["relpath"])
            facts.append(FileFacts(f["relpath"], f["size"], f["mtime_ns"], f["facts_format"]))
            files.append(PartFile(part.host, f["relpath"], f["size"], f["mtime_ns"], f["sha256"], f["format"],
                                  tuple(f["shards"])))
    return facts, files, used


def claimed(session: Session, path: str, host: str) -> CheckpointPart | None:
    """``host``'s part at ``path``, if a checkpoint has claimed it."""
    return session.scalar(select(CheckpointPart).where(CheckpointPart.host == host, CheckpointPart.path == path,
                                                       CheckpointPart.checkpoint_id.is_not(None)))


def held(session: Session, host: str, *, path: str | None = None) -> list[CheckpointPart]:
    """``host``'s parts that it still holds (locked on PostgreSQL, in key order as every multi-row
    lock: a rotation deciding commits first)."""
    q = select(CheckpointPart).where(CheckpointPart.host == host, CheckpointPart.local_present.is_(True))
    if path is not None:
        q = q.where(CheckpointPart.path == path)
    return list(session.scalars(q.order_by(CheckpointPart.id).with_for_update()))


def vanished(session: Session, part: CheckpointPart) -> None:
    """``part``'s files are gone from its host. A checkpoint it belongs to that was not
    protected yet cannot be any more: it ends ``vanished``, as when its own files go."""
    part.local_present = False
    if part.checkpoint_id is None:
        return
    job = latest_store_job(session, part.checkpoint_id)
    if job is not None and job.state not in (StoreState.VERIFIED, StoreState.ROTATED):
        ckpt = session.get(Checkpoint, part.checkpoint_id)
        if ckpt is not None:
            mark_vanished(session, ckpt)
