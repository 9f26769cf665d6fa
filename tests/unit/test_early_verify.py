"""A copy is counted as verified only on its worker's re-hash from disk (invariant 4):
a copy whose re-hash right after upload does not match stays 'stored', and the verify step
re-hashes it, finds it corrupt and places it elsewhere; copies that matched at upload are
only confirmed present, not read again."""
from __future__ import annotations

from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy, Job, StorageWorker
from pipeline.db.transitions import now
from pipeline.store import replication, verification
from pipeline.store.sharding import shard_checkpoint
from tests.unit.test_sharding import detected  # noqa: F401  (the fixture)

BAD_URL = "http://127.0.0.1:7000"  # worker w-0: its disk returns other bytes than it received


class FakeWorker:
    calls: list[tuple[str, str, tuple[str, ...]]] = []

    def __init__(self, url: str, key: bytes, node: str) -> None:
        self.url = url

    def head(self, name: str):
        return None

    def put_range(self, name, header, path, offset, length):
        return {"created": True}

    def verify(self, names: list[str], rate: float = 0):
        FakeWorker.calls.append(("verify", self.url, tuple(names)))
        return [{"name": n, "sha256": ("0" * 64 if self.url == BAD_URL else n), "size": 1} for n in names]

    def stat(self, names: list[str]):
        FakeWorker.calls.append(("stat", self.url, tuple(names)))
        return {n: self.sizes[n] for n in names}

    sizes: dict[str, int] = {}


def copy_states(db):
    with session_scope(db.db_url) as s:
        return [(c.worker_id, c.state) for c in s.scalars(select(ContentCopy).order_by(ContentCopy.id))]


def test_a_copy_that_fails_its_upload_rehash_is_replaced_at_verify(detected, monkeypatch):  # noqa: F811
    db, path, job_id = detected
    with session_scope(db.db_url) as s:  # a third worker, so replacements have somewhere to go
        s.add(StorageWorker(id="w-2", url="http://127.0.0.1:7002", source="static", state="up",
                            free_bytes=10**10, capacity_bytes=10**10, last_seen=now()))
    monkeypatch.setattr(replication, "WorkerClient", FakeWorker)
    monkeypatch.setattr(verification, "WorkerClient", FakeWorker)
    sends = shard_checkpoint(db, job_id)
    with session_scope(db.db_url) as s:
        FakeWorker.sizes = {c.sha256: c.content.size for c in s.scalars(select(ContentCopy))}
    for send in sends:
        replication.replicate(db, *send.args)

    states = copy_states(db)
    on_bad = [st for w, st in states if w == "w-0"]
    assert on_bad and set(on_bad) == {"stored"}  # the mismatching re-hash did not count
    assert all(st == "verified" for w, st in states if w != "w-0")
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == "replicated"

    FakeWorker.calls.clear()
    sends = verification.verify_checkpoint(db, job_id)
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == "sharded"  # back to re-replicate
    states = copy_states(db)
    assert {st for w, st in states if w == "w-0"} == {"corrupt"}
    assert len([1 for _w, st in states if st == "pending"]) == len(on_bad) == len(sends)
    # Only the copies that failed at upload were read again; the others were only confirmed.
    reread = {(kind, url) for kind, url, _ in FakeWorker.calls if kind == "verify"}
    assert reread == {("verify", BAD_URL)}
    assert sum(len(names) for kind, _u, names in FakeWorker.calls if kind == "verify") == len(on_bad)
