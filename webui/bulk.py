"""Pin, unpin or forget several checkpoints at once (the lists' checkboxes, ``POST
/api/checkpoints/bulk``): one at a time through the same operations as the single forms and
``ckpt pin`` / ``ckpt forget``, so each one is done or refused on its own, with the reason.

A dry run says what would happen without changing anything: forgetting runs the forget's own
``dry_run``; pinning runs the real pin in a transaction that is then rolled back.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select

from pipeline import operations
from pipeline.cli.retention_cmds import LAST_COPY
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointPart
from pipeline.errors import CkptError
from pipeline.integrity import retention
from pipeline.settings import Settings

ACTIONS = ("pin", "unpin", "forget")


@dataclass(frozen=True)
class Outcome:
    """What happened (or would) to one checkpoint."""

    id: int
    path: str | None
    ok: bool
    message: str
    #: Forgetting it leaves its local copy on the training disk as the ONLY copy.
    only_local_copy: bool = False


class _Rehearsal(Exception):
    """Raised to roll back a rehearsed pin."""


def last_copy(settings: Settings) -> str:
    """What forgetting means for the bytes, in the words of ``ckpt forget``."""
    return LAST_COPY.format(grace=settings.gc_grace_seconds, keep=settings.keep_last)


def run(settings: Settings, action: str, ids: list[int], *, note: str | None = None,
        dry_run: bool = False) -> list[Outcome]:
    """``action`` on each of ``ids`` in turn; a refusal is that checkpoint's outcome, not an error."""
    if action not in ACTIONS:
        raise ValueError(f"unknown bulk action {action!r}")
    return [_one(settings, action, cid, note, dry_run) for cid in dict.fromkeys(ids)]


def _one(settings: Settings, action: str, cid: int, note: str | None, dry_run: bool) -> Outcome:
    local = _local_copies(settings, cid)
    if local is None:
        # An id, never a path: the operations below also take a path, and a number with no
        # checkpoint behind it would name a step directory (`run/12000`) under the UI's cwd.
        return Outcome(cid, None, False, f"refused: no checkpoint {cid}")
    path = local[0]
    try:
        if action == "forget":
            operations.forget(settings, [str(cid)], dry_run=dry_run)
            alone = bool(local and local[1])
            said = "would be forgotten" if dry_run else "forgotten"
            return Outcome(cid, path, True, f"{said}: it can no longer be restored" + (
                "; its local copy on the training disk is then the ONLY copy" if alone else
                "; it has no local copy: nothing of it is left once its content is collected"), alone)
        if dry_run:
            _rehearse(settings, cid, note, action == "pin")
        else:
            operations.pin(settings, str(cid), note, pinned=action == "pin")
        if action == "pin":
            return Outcome(cid, path, True, ("would be pinned" if dry_run else "pinned")
                           + ": the remote retention policy and forgetting keep it")
        return Outcome(cid, path, True, "would be unpinned" if dry_run else "unpinned")
    except CkptError as e:  # unknown, pinned, the newest of its run, not protected...: refused, said why
        return Outcome(cid, path, False, f"refused: {e}")


def _rehearse(settings: Settings, cid: int, note: str | None, pinned: bool) -> None:
    try:
        with session_scope(settings.db_url) as s:
            retention.pin(s, str(cid), note, pinned=pinned)
            raise _Rehearsal
    except _Rehearsal:
        pass


def _local_copies(settings: Settings, cid: int) -> tuple[str, bool] | None:
    """The checkpoint's path and whether any of its local copy is still on a training disk."""
    with session_scope(settings.db_url, readonly=True) as s:
        c = s.get(Checkpoint, cid)
        if c is None:
            return None
        part = s.scalar(select(CheckpointPart.id).where(CheckpointPart.checkpoint_id == cid,
                                                         CheckpointPart.local_present.is_(True)).limit(1))
        return c.path, bool(c.local_present or part is not None)


def as_json(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    return [asdict(o) for o in outcomes]
