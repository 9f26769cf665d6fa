"""`ckpt status` and /metrics show the object-store tier on its own: per target its state, use
and copies; per checkpoint whose run wants object-store copies, how many of its contents are
confirmed there, so a lagging copy is visible (one grouped query per page, never per row)."""
from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

from pipeline import settings as settings_mod
from pipeline import status
from pipeline.cli.status_view import full
from pipeline.db.engine import session_scope
from pipeline.db.models import Content, ContentCopy, StorageWorker
from pipeline.db.transitions import now
from pipeline.objectstore import report
from tests.unit.test_content_gc import checkpoint, sha, workers

TARGET = {"name": "store", "url": "s3://bucket/ckpt", "endpoint": "http://127.0.0.1:1", "region": "us-east-1",
          "quota_bytes": 10**9}


def test_status_shows_each_target_and_how_many_contents_are_confirmed_on_object_stores(db, capsys):
    settings = settings_mod.configure(dataclasses.replace(db, targets=json.dumps([TARGET])))
    t = now() - timedelta(minutes=1)
    with session_scope(settings.db_url) as s:
        workers(s)
        s.add(StorageWorker(id="target:store", url=TARGET["url"], source="target", tier="objectstore", state="up",
                            capacity_bytes=10**9, free_bytes=10**9, last_seen=t))
        s.flush()
        cid = checkpoint(s, "step_1", [1, 2, 3])
        s.add(ContentCopy(sha256=sha(1), worker_id="target:store", state="verified", stored_at=t, verified_at=t,
                          attempts=0))
        s.add(ContentCopy(sha256=sha(2), worker_id="target:store", state="pending", attempts=0))
        s.add(Content(sha256=sha(9), size=5, state="condemned"))  # not a page's: no effect

    doc = status.status(settings)
    (row,) = [c for c in doc["checkpoints"] if c["id"] == cid]
    assert row["objectstore"] == {"contents": 3, "confirmed": 1, "wanted": 1, "mode": "lag"}
    assert doc["objectstores"] == [{"id": "target:store", "url": TARGET["url"], "state": "up", "used_bytes": 1000,
                                    "quota_bytes": 10**9, "copies": 1, "last_error": None,
                                    "endpoint": TARGET["endpoint"]}]
    with session_scope(settings.db_url, readonly=True) as s:
        assert report.lagging_contents(s) == 1

    full(doc)
    out = capsys.readouterr().out
    assert "object store: 1/3 contents confirmed, lagging" in out
    assert "target:store     up" in out and "1 copies" in out
    storage = out.split("storage workers:")[1].split("object stores:")[0]
    assert "target:store" not in storage  # the workers' tier lists storage workers only

    required = settings_mod.configure(dataclasses.replace(settings, target_mode="required"))
    (row,) = [c for c in status.status(required)["checkpoints"] if c["id"] == cid]
    assert report.words(row["objectstore"]) == "object store: 1/3 contents confirmed, required"
