"""Bytes broken in transit between the actors and a storage worker: a flipped bit, a reset
connection, a body cut short. Every byte is checked against the manifest on receipt, so
each is caught, retried or taken from another copy, and nothing wrong is stored or restored."""
from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import StorageWorker
from pipeline.detection.catalog import resolve
from pipeline.restoring.gather import manifest
from tests.faults.harness import FaultCluster, Table, store_until, trial
from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

#: Far enough into a connection to land in a shard's body, not its request line.
INTO_BODY = 2000


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    c = FaultCluster(tmp_path_factory.mktemp("transit"), proxy=True)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.mark.parametrize("kind", ["flip", "reset", "truncate"])
def test_upload_broken_in_transit(proxied: FaultCluster, trials: int, kind: str):
    c = proxied
    row = Table.row(f"upload to a worker: {kind} in transit")
    for _ in range(trials):
        applied = c.proxy.applied
        c.proxy.arm(kind, "up", INTO_BODY)
        # Placement decides whether a store sends anything to the proxied worker.
        trial(c, row, lambda: store_until(c, lambda: c.proxy.applied > applied, "hit an upload"), None)
        assert c.proxy.applied == applied + 1
        # The worker may be taken for down meanwhile (a repair then tops the others up).
        assert all("store verified" in o and "failed" not in o for o in row.outcomes), row.outcomes
    assert row.ok, row.problems


def worker_state(c: FaultCluster, node_id: str) -> str | None:
    with session_scope(c.settings.db_url) as s:
        return s.scalar(select(StorageWorker.state).where(StorageWorker.id == node_id))


def read_through_proxy(c: FaultCluster, path: Path) -> bool:
    """Whether a restore of ``path`` reads, from the proxied worker first, a shard that
    carries more than ``INTO_BODY`` bytes (the fault's offset: a smaller one, such as a
    file's header shard, ends before the fault and passes through untouched)."""
    proxied_id = c.workers[0].node_id
    with session_scope(c.settings.db_url) as s:
        files = manifest(s, resolve(s, str(path)))
    return any(sh.copies and sh.copies[0][0] == proxied_id and sh.size > INTO_BODY
               for f in files for sh in f.shards)


def checkpoint_read_through_proxy(c: FaultCluster) -> Path:
    """A new checkpoint that a restore reads partly through the proxy (placement decides
    which worker comes first: new checkpoints until one qualifies)."""
    for _ in range(20):
        path = c.new_checkpoint()
        c.quiet()
        if read_through_proxy(c, path):
            return path
    raise AssertionError("20 checkpoints and none had a shard read from the proxied worker first")


@pytest.mark.parametrize("kind", ["flip", "reset", "truncate"])
def test_restore_download_broken_in_transit(proxied: FaultCluster, trials: int, kind: str, tmp_path):
    c = proxied
    src = checkpoint_read_through_proxy(c)
    row = Table.row(f"restore from a worker: {kind} in transit")
    for i in range(trials):
        dest = tmp_path / f"r{i}.safetensors"
        applied = c.proxy.applied

        def restore() -> None:
            # A reset or cut may have got the worker marked down: a restore would then read
            # it last. The scheduler's next probe finds it up again.
            wait_for(lambda: worker_state(c, c.workers[0].node_id) == "up", 30, "the proxied worker up")
            # What the restore will read first is decided now, from the manifest it will use.
            assert read_through_proxy(c, src), "the replica order changed since the checkpoint was chosen"
            c.proxy.arm(kind, "down", INTO_BODY)
            job = c.restore(src, dest)
            assert job.state == "done", job.last_error

        trial(c, row, restore, None)
        wait_for(lambda: c.proxy.applied == applied + 1, 5, "the fault to hit a download")
        assert dest.read_bytes() == src.read_bytes()
    assert row.ok, row.problems
