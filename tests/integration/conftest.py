"""Integration fixtures: a real cluster per test (or per module), always torn down."""
from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.detection.catalog import latest_store_job
from tests.processes import Cluster, wait_for


def checkpoint_job(cluster: Cluster, path: Path, timeout: float = 60) -> int:
    """Id of the store job of the checkpoint at ``path`` (once the watcher detected it)."""
    def find():
        with session_scope(cluster.settings.db_url) as s:
            c = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path.resolve()))
                         .order_by(Checkpoint.id.desc()).limit(1))
            if c is None:
                return None
            job = latest_store_job(s, c.id)
            return job.id if job else None

    return wait_for(find, timeout, f"detection of {path}")


@pytest.fixture
def make_cluster(tmp_path):
    started: list[Cluster] = []

    def make(**kwargs) -> Cluster:
        c = Cluster(tmp_path / f"c{len(started)}", **kwargs)
        started.append(c)
        return c.start()

    yield make
    errors = []
    for c in started:
        try:
            c.stop()
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, errors


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("shared"))
    try:
        yield c.start()
    finally:
        c.stop()
