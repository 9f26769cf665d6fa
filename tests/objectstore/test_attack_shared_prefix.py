"""Attack: two storage rows that name the same objects (one bucket and prefix).

Keys are content addressed, so every target at one bucket and prefix names the same object for
a content. A target renamed in config.toml gets a new row id (``target:<name>``); a table
written twice by hand (``ckpt target add`` refuses it, the loader did not) makes two counting
rows. The orphan sweep of one row asked only its own copy rows whether an object is named, so it
deleted the object another row's verified copy counts on: with ``target_mode = "required"`` that
copy let rotation delete the local checkpoint (real SeaweedFS, real control plane).
"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
from sqlalchemy import select

from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy
from pipeline.errors import ConfigError
from pipeline.integrity import gc
from pipeline.objectstore import tier
from pipeline.objectstore.config import parse_targets
from tests.objectstore.test_collection import GRACE, ROW, put_all, record
from tests.objectstore.test_tier import in_bucket


def configured(settings, endpoint: str, bucket: str, *names: str):
    tables = [{"name": n, "url": f"s3://{bucket}/ckpt", "endpoint": endpoint, "region": "us-east-1",
               "addressing_style": "path", "max_attempts": 2, "connect_timeout": 2, "read_timeout": 10}
              for n in names]
    return settings_mod.configure(dataclasses.replace(settings, targets=json.dumps(tables), gc_rate=0.0,
                                                      gc_batch=2, gc_orphan_grace_seconds=GRACE))


def collect_on(settings, worker_id: str) -> None:
    with session_scope(settings.db_url) as s:
        (job_id,) = [j.id for j in gc.request_gc(s, settings) if j.params["worker_id"] == worker_id]
    gc.collect(settings, job_id)


def test_a_renamed_target_never_deletes_the_objects_its_old_row_counts(db, server, bucket, tmp_path):
    before = configured(db, server.endpoint, bucket, "store")
    tier.probe(before)
    shas = put_all(before, tmp_path, ["kept"])
    record(before, shas, {"kept": "verified"}, condemned=set())
    time.sleep(GRACE + 1.5)

    after = configured(db, server.endpoint, bucket, "archive")  # the same bucket, renamed in config.toml
    tier.probe(after)  # target:store is down ("no longer configured"), target:archive up
    collect_on(after, "target:archive")

    # The bucket still holds what a copy row names as verified: renaming it back (or a restore
    # from it) finds the bytes.
    assert set(in_bucket(server, bucket)) == set(shas.values())
    with session_scope(after.db_url) as s:
        assert s.scalar(select(ContentCopy.state).where(ContentCopy.worker_id == ROW)) == "verified"


def test_two_targets_at_one_bucket_and_prefix_are_refused_as_read(tmp_path):
    tables = [{"name": n, "url": "s3://ckpt-bucket/team/", "endpoint": "http://127.0.0.1:8333"}
              for n in ("store", "twin")]
    tables[1]["url"] = "s3://ckpt-bucket/team"  # the same prefix, written another way
    with pytest.raises(ConfigError, match="same"):
        parse_targets(tables, "config.toml")
