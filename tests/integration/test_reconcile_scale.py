"""A storage worker holding 200,000 shards comes back and is reconciled: page by page, with the
cursor saved after each page, so it finishes (one request for everything used to run into the
600 s read timeout) and a reconcile killed half-way resumes where it was.

A real storage worker process on loopback holds small shard files (written straight into its
store, as if it had received them over months); the control plane (SQLite) expects most of
them, expects some it does not hold, and does not know some it holds. 20,000 of them by
default; the full 200,000 (about 100 s here) with ``pytest --full-scale``: the paging and the
resume are the same, only the time differs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time

import pytest
from sqlalchemy import func, insert, select

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Content, ContentCopy, Job, StorageWorker
from pipeline.db.transitions import now
from pipeline.integrity import reconcile as reconcile_mod
from tests.processes import KEY, base_env
from tests.processes import StorageWorker as WorkerProcess

pytestmark = pytest.mark.integration

ABSENT, UNKNOWN = 500, 300


@pytest.fixture
def held(request) -> int:
    return 200_000 if request.config.getoption("--full-scale") else 20_000


def payload(i: int) -> bytes:
    return f"shard {i:08d}".encode()


@pytest.fixture
def worker(tmp_path, held):
    data = tmp_path / "w0"
    # Written straight into the store's layout before the worker starts (it counts them at start).
    for i in range(held + UNKNOWN):
        body = payload(i)
        name = hashlib.sha256(body).hexdigest()
        d = data / "shards" / name[:2] / name[2:4]
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(body)
    w = WorkerProcess(data, base_env(tmp_path / "home"), tmp_path / "w0.log")
    w.start()
    try:
        yield w
    finally:
        w.kill()


def test_a_worker_with_200k_shards_is_reconciled_page_by_page_and_resumes(worker, held, settings, monkeypatch):
    s = dataclasses.replace(settings, cluster_key=KEY, scrub_batch=2000, scrub_rate=0, rf=1)
    upgrade(s.db_url)
    t = now()
    node = worker.node_id  # requests name the node they are meant for
    expected = [hashlib.sha256(payload(i)).hexdigest() for i in range(held)]
    absent = [hashlib.sha256(f"absent {i}".encode()).hexdigest() for i in range(ABSENT)]
    with session_scope(s.db_url) as db:
        db.add(StorageWorker(id=node, url=worker.url, source="static", state="up", capacity_bytes=10**12,
                             free_bytes=10**12, last_seen=t))
        db.flush()
        rows = [{"sha256": sha, "size": 14, "state": "live", "created_at": t, "last_referenced_at": t}
                for sha in expected + absent]
        copies = [{"sha256": sha, "worker_id": node, "state": "verified", "attempts": 0, "stored_at": t,
                   "verified_at": t, "size": 14} for sha in expected + absent]
        for i in range(0, len(rows), 20_000):
            db.execute(insert(Content), rows[i:i + 20_000])
            db.execute(insert(ContentCopy), copies[i:i + 20_000])
        job_id = reconcile_mod.request_reconcile(db, s, node, "it came back").id

    # The first run is cut off (as a killed process would be) after a quarter of the pages.
    cut = held // reconcile_mod.PAGE // 4
    pages = {"n": 0}
    real_page = reconcile_mod.WorkerClient.inventory_page

    def counted(self, after: str = "", limit: int = 1000):
        pages["n"] += 1
        if pages["n"] > cut and not pages.get("resumed"):
            raise KeyboardInterrupt("killed")
        return real_page(self, after=after, limit=limit)

    monkeypatch.setattr(reconcile_mod.WorkerClient, "inventory_page", counted)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        reconcile_mod.reconcile(s, job_id)
    with session_scope(s.db_url) as db:
        job = db.get(Job, job_id)
        cursor, held_so_far = job.params["cursor"], job.params["held"]
    assert job.state == "reconciling" and held_so_far == cut * reconcile_mod.PAGE and cursor

    pages["resumed"], pages["n"] = True, 0
    reconcile_mod.reconcile(s, job_id)  # the re-drive: from the saved cursor, not from the start
    seconds = time.monotonic() - started
    with session_scope(s.db_url) as db:
        job = db.get(Job, job_id)
        verified = db.scalar(select(func.count(ContentCopy.id)).where(ContentCopy.state == "verified"))
        missing = db.scalar(select(func.count(ContentCopy.id)).where(ContentCopy.state == "missing"))
    total = held + UNKNOWN
    assert job.state == "done", job.last_error
    assert job.params["held"] == total and job.params["matched"] == held
    assert job.params["unknown"] == UNKNOWN and job.params["bad"] == ABSENT
    assert verified == held and missing == ABSENT
    assert pages["n"] <= total // reconcile_mod.PAGE - cut + 2  # the second run started from the cursor
    assert len(worker.quarantined()) == UNKNOWN
    print(f"reconciled {total:,} shards in {seconds:.1f} s")
