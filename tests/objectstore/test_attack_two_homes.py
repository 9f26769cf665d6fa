"""Attack: two homes (two control planes) configured at one bucket and prefix.

Before each control plane owned its prefixes (``<prefix>/.ckpt-home``, migration 0018), nothing
stopped it: ``ckpt target add`` checks only its own config.toml, and the design even
counts "an object the store already holds under the name (another home's ...)" as a copy
(pipeline/store/bucket_copy.py ``_held``). But each home's collection treats every object whose
content it does not know as an orphan (pipeline/objectstore/orphans.py ``claim``: no content
row, so doomed) and deletes it once older than the grace: home B deletes the object home A
confirmed and counts, with ``target_mode = "required"`` after A's rotation deleted the local
checkpoint on the strength of it (real SeaweedFS, two real SQLite control planes).
"""
from __future__ import annotations

import dataclasses
import time

from sqlalchemy import select

from pipeline import settings as settings_mod
from pipeline.db.engine import dispose_all, session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import ContentCopy, StorageWorker
from pipeline.integrity import gc
from pipeline.objectstore import tier
from tests.objectstore.test_collection import GRACE, ROW, put_all, record, with_target
from tests.objectstore.test_tier import in_bucket


def test_another_home_at_the_same_prefix_never_deletes_this_homes_copies(settings, server, bucket, tmp_path):
    upgrade(settings.db_url)
    home_a = with_target(settings, server.endpoint, bucket)
    other = settings_mod.load({"home": tmp_path / "home-b", "roots": (str(tmp_path / "runs-b" / "*"),),
                               "cluster_key": "other-key", "redis_url": "stub://"}, environ={})
    upgrade(other.db_url)
    home_b = with_target(dataclasses.replace(other), server.endpoint, bucket)
    try:
        tier.probe(home_a)
        tier.probe(home_b)
        shas = put_all(home_a, tmp_path, ["a's"])
        record(home_a, shas, {"a's": "verified"}, condemned=set())  # home A's confirmed copy
        time.sleep(GRACE + 1.5)

        # The prefix is home A's (its .ckpt-home names A's control plane): B's row is down, saying so.
        with session_scope(home_b.db_url) as s:
            row = s.get(StorageWorker, ROW)
            assert row is not None and row.state == "down" and "belongs to another ckpt home" in row.last_error
            jobs = [j.id for j in gc.request_gc(s, home_b) if j.params["worker_id"] == ROW]
        for job_id in jobs:  # a collection asked of it anyway deletes nothing of A's
            gc.collect(home_b, job_id)

        with session_scope(home_a.db_url) as s:
            assert s.scalar(select(ContentCopy.state).where(ContentCopy.worker_id == ROW)) == "verified"
        assert set(in_bucket(server, bucket)) == set(shas.values())
    finally:
        dispose_all()
        settings_mod.configure(settings)
