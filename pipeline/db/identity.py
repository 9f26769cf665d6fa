"""This control plane's identity: a random id made once (migration 0018), which it writes into
the bucket prefixes it uses so that no other control plane takes them (pipeline/objectstore/tier.py)."""
from __future__ import annotations

import uuid

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pipeline.db.models import ControlPlane


def control_plane_id(session: Session) -> str:
    """The id of the control plane whose database ``session`` reads (made here if a database
    built without migrations lacks it; two makers race to one row, the first wins)."""
    row = session.get(ControlPlane, "this")
    if row is None:
        try:
            with session.begin_nested():
                session.add(ControlPlane(name="this", id=str(uuid.uuid4())))
        except IntegrityError:
            pass
        row = session.get(ControlPlane, "this", populate_existing=True)
        assert row is not None
    return row.id


__all__ = ["control_plane_id"]
