"""Garbage collection on an object store, against a real SeaweedFS bucket and a real control
plane (SQLite, and PostgreSQL when there is one).

A target's collection deletes its copies of condemned content, then pages through the bucket
and deletes the orphans (objects no copy row names) the store says are older than the grace;
never a young object (a put in flight, a listing behind), never one a pending or held copy
names. A store that throttles leaves the job to be driven again, nothing forgotten.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.models import Content, ContentCopy, Job
from pipeline.db.transitions import now
from pipeline.integrity import gc
from pipeline.objectstore import orphans, tier
from tests.objectstore.conftest import FlakyFront

ROW = "target:store"
GRACE = 2.0


def with_target(settings, endpoint: str, bucket: str):
    table = {"name": "store", "url": f"s3://{bucket}/ckpt", "endpoint": endpoint, "region": "us-east-1",
             "addressing_style": "path", "max_attempts": 2, "connect_timeout": 2, "read_timeout": 10}
    return settings_mod.configure(dataclasses.replace(settings, targets=json.dumps([table]), gc_rate=0.0,
                                                      gc_batch=2, gc_orphan_grace_seconds=GRACE))


def blob(tmp_path: Path, n: int) -> tuple[str, Path]:
    data = os.urandom(1000 + n)
    path = tmp_path / f"blob{n}"
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest(), path


def put_all(settings, tmp_path: Path, names: list[str], first: int = 0) -> dict[str, str]:
    store = tier.store_for(settings, ROW)
    out = {}
    for i, name in enumerate(names, first):
        sha, path = blob(tmp_path, i)
        store.put(sha, path)
        out[name] = sha
    return out


def record(settings, shas: dict[str, str], copies: dict[str, str], condemned: set[str]) -> None:
    """Content rows for ``shas`` (condemned ones so), and a copy on the target in each state of ``copies``."""
    t = now() - timedelta(minutes=5)
    with session_scope(settings.db_url) as s:
        for name, sha in shas.items():
            content = Content(sha256=sha, size=1000, state="condemned" if name in condemned else "live")
            s.add(content)
            if name in copies:
                held = copies[name] in ("stored", "verified")
                content.copies.append(ContentCopy(worker_id=ROW, state=copies[name], attempts=0,
                                                  stored_at=t if held else None,
                                                  verified_at=t if copies[name] == "verified" else None))


def in_bucket(settings) -> set[str]:
    return {o.sha256 for o in tier.store_for(settings, ROW).inventory()}


def target_rows(settings) -> dict[str, str]:
    with session_scope(settings.db_url) as s:
        return dict(s.execute(select(ContentCopy.sha256, ContentCopy.state).where(ContentCopy.worker_id == ROW)).all())


def collection_job(settings) -> int:
    with session_scope(settings.db_url) as s:
        jobs = gc.request_gc(s, settings)
        (job_id,) = [j.id for j in jobs if j.params["worker_id"] == ROW]
        return job_id


def test_collection_deletes_condemned_copies_and_old_orphans_never_a_young_or_named_object(db, server, bucket,
                                                                                           tmp_path, monkeypatch):
    settings = with_target(db, server.endpoint, bucket)
    tier.probe(settings)  # records the target's row: up
    shas = put_all(settings, tmp_path, ["condemned", "unknown", "known", "pending", "verified", "abandoned"])
    known = {k: v for k, v in shas.items() if k != "unknown"}  # "unknown": a home restored from an older database
    record(settings, known, {"condemned": "verified", "pending": "pending", "verified": "verified",
                             "abandoned": "abandoned"}, condemned={"condemned"})
    time.sleep(1.1)  # the store's LastModified is in whole seconds: the young put is a second later
    young = put_all(settings, tmp_path, ["young"], first=10)["young"]  # a put just made: no row names it yet
    # The collector's clock stands still GRACE - 0.5 s after the young put, as the store dated
    # it: the young object is 1.5 s old, every other at least 2.5 s, however long the
    # collection itself takes on a loaded machine.
    dated = {o.sha256: o.last_modified for o in tier.store_for(settings, ROW).inventory()}
    assert dated[young] > max(t for sha, t in dated.items() if sha != young), dated
    frozen = dated[young] + timedelta(seconds=GRACE - 0.5)
    monkeypatch.setattr(orphans, "now", lambda: frozen)

    job_id = collection_job(settings)
    assert gc.collect(settings, job_id) == []

    assert in_bucket(settings) == {shas["pending"], shas["verified"], young}
    assert target_rows(settings) == {shas["pending"]: "pending", shas["verified"]: "verified"}
    with session_scope(settings.db_url) as s:
        assert s.get(Content, shas["condemned"]).state == "deleted"
        assert s.get(Content, shas["known"]).state == "live"
        job = s.get(Job, job_id)
        assert job.state == "done", job.detail
        assert (job.params["deleted"], job.params["orphans"]) == (4, 3)


def test_a_throttling_store_leaves_the_collection_to_be_driven_again_nothing_forgotten(db, server, bucket,
                                                                                       tmp_path):
    front = FlakyFront(server.ports["s3.port"], 503, "SlowDown", failures=0)
    try:
        settings = with_target(db, front.endpoint, bucket)
        tier.probe(settings)
        shas = put_all(settings, tmp_path, ["condemned"])
        record(settings, shas, {"condemned": "verified"}, condemned={"condemned"})
        job_id = collection_job(settings)

        front.failures = 10**6
        assert gc.collect(settings, job_id) == []
        with session_scope(settings.db_url) as s:
            job = s.get(Job, job_id)
            assert job.state == "collecting" and job.params["deleted"] == 0
            assert s.get(Content, shas["condemned"]).state == "condemned"
        assert target_rows(settings) == {shas["condemned"]: "deleting"}  # condemned: it counted for nothing

        front.failures = 0  # the lease ends; the scheduler drives the job again
        assert gc.collect(settings, job_id) == []
        assert in_bucket(settings) == set() and target_rows(settings) == {}
        with session_scope(settings.db_url) as s:
            assert s.get(Job, job_id).state == "done"
            assert s.get(Content, shas["condemned"]).state == "deleted"
    finally:
        front.close()


def test_an_old_object_a_copy_row_names_is_never_an_orphan(db, server, bucket, tmp_path):
    settings = with_target(db, server.endpoint, bucket)
    tier.probe(settings)
    named = ["pending", "stored", "verified", "corrupt", "missing"]  # a put in flight, or a file held
    shas = put_all(settings, tmp_path, named)
    record(settings, shas, {n: n for n in named}, condemned=set())
    time.sleep(GRACE + 1.5)
    gc.collect(settings, collection_job(settings))
    assert in_bucket(settings) == set(shas.values())
    assert target_rows(settings) == {sha: n for n, sha in shas.items()}
