"""A copy is counted as verified only on its worker's re-hash from disk (invariant 4):
a copy whose re-hash right after upload does not match stays 'stored', and the verify step
re-hashes it, finds it corrupt and places it elsewhere; copies that matched at upload are
only confirmed present, not read again."""
from __future__ import annotations

from sqlalchemy import func, select

from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, ContentCopy, Job, JobEvent, Shard, StorageWorker
from pipeline.db.transitions import now
from pipeline.store import replication, verification
from pipeline.store.sharding import shard_checkpoint
from tests.unit.test_sharding import detected  # noqa: F401  (the fixture)

BAD_URL = "http://127.0.0.1:7000"  # worker w-0: its disk returns other bytes than it received


class FakeWorker:
    calls: list[tuple[str, str, tuple[str, ...]]] = []

    def __init__(self, url: str, key: bytes, node: str, *, timeout: float = 0) -> None:
        self.url = url

    def head(self, name: str):
        return None

    def put_range(self, name, header, path, offset, length, chain=(), wire="off", codecs=()):
        return {"created": True, "chain": [{"node": node, "ok": True, "created": True} for node, _url in chain]}

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


class RefusingHops(FakeWorker):
    """A first worker whose chain reports every hop after it as failed."""

    def put_range(self, name, header, path, offset, length, chain=(), wire="off", codecs=()):
        FakeWorker.calls.append(("put", self.url, (name,)))
        return {"created": True, "chain": [{"node": node, "ok": False, "error": "refused"} for node, _ in chain]}


def test_a_hop_the_chain_did_not_reach_is_sent_on_its_own(detected, monkeypatch):  # noqa: F811
    db, path, job_id = detected
    monkeypatch.setattr(replication, "WorkerClient", RefusingHops)
    sends = shard_checkpoint(db, job_id)
    FakeWorker.calls.clear()
    first, rest = sends[0].args
    again = replication.replicate(db, first, rest)
    with session_scope(db.db_url) as s:
        assert s.get(ContentCopy, first).state in ("verified", "stored")
        assert [s.get(ContentCopy, i).state for i in rest] == ["pending"]  # not counted on the relay's word
        assert s.get(ContentCopy, rest[0]).attempts == 1
    assert [(a.actor, a.args) for a in again] == [("replicate", (rest[0],))]  # alone: no chain
    assert [kind for kind, *_ in FakeWorker.calls] == ["put", "verify"]  # the hop was never re-hashed


def test_fanout_sends_each_copy_from_the_host(detected, monkeypatch):  # noqa: F811
    import dataclasses

    db, path, job_id = detected
    fan = dataclasses.replace(db, replication="fanout")
    sends = shard_checkpoint(fan, job_id)
    with session_scope(db.db_url) as s:
        pending = s.scalars(select(ContentCopy.id).where(ContentCopy.state == "pending")).all()
    assert sorted(a.args for a in sends) == sorted((i,) for i in pending)


class SourceGone(FakeWorker):
    def put_range(self, name, header, path, offset, length, chain=(), wire="off", codecs=()):
        raise FileNotFoundError(path)  # deleted before it was protected


def test_a_chain_whose_source_vanished_leaves_no_copy_unsent(detected, monkeypatch):  # noqa: F811
    db, path, job_id = detected
    monkeypatch.setattr(replication, "WorkerClient", SourceGone)
    sends = shard_checkpoint(db, job_id)
    first, rest = sends[0].args
    after = replication.replicate(db, first, rest)
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == "vanished"
    # As in a fan-out, where each copy has its message: each copy the chain would have carried
    # is sent on its own, and finds the source gone or a peer's copy.
    assert ("replicate", (rest[0],)) in [(a.actor, a.args) for a in after]


class RotsLater(FakeWorker):
    """Re-hashes right until a content is named in ``rotten``."""
    rotten: set[str] = set()

    def verify(self, names: list[str], rate: float = 0):
        FakeWorker.calls.append(("verify", self.url, tuple(names)))
        return [{"name": n, "sha256": "0" * 64 if n in RotsLater.rotten else n, "size": 1} for n in names]


def _store(db, job_id: int) -> None:
    """Shard, replicate (with the recheck the shard step asks for, first) and verify one store."""
    for send in shard_checkpoint(db, job_id):
        if send.actor == "recheck":
            assert verification.recheck_shared(db, *send.args) == []
        else:
            replication.replicate(db, *send.args)
    with session_scope(db.db_url) as s:
        FakeWorker.sizes = {c.sha256: c.content.size for c in s.scalars(select(ContentCopy))}
    verification.verify_checkpoint(db, job_id)


def _next_step(db, path, half_changed: bool = True) -> tuple[int, set[str]]:
    """Step 2 of the run with the first half of step 1's tensors unchanged; its job and the
    contents it shares with step 1."""
    from safetensors.torch import load_file

    from pipeline.db.models import CheckpointFile, Shard
    from pipeline.detection import catalog, completeness
    from tests.checkpoints import atomic_save

    sd = load_file(path)
    for name in sorted(sd)[len(sd) // 2:]:
        sd[name] = sd[name] + 1
    step2 = atomic_save(sd, path.with_name("step_2.safetensors"))
    d = catalog.hash_checkpoint(path.parent, step2, completeness.inspect(step2), shard_size=db.shard_size)
    with session_scope(db.db_url) as s:
        _ckpt, job, _ = catalog.record(s, d, lease_seconds=60, detail="test")
        shas = [set(s.scalars(select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == c)))
                for c in (1, job.checkpoint_id)]
        return job.id, shas[0] & shas[1]


def test_copies_a_step_shares_are_rehashed_beside_its_uploads(detected, monkeypatch):  # noqa: F811
    """A step with half of its tensors unchanged: the shard step asks, first, for the copies
    it shares with the step before to be re-hashed while its new copies are sent; the verify
    step then only confirms them (they were re-hashed during this store) instead of reading
    them after the last upload."""
    db, path, job_id = detected
    monkeypatch.setattr(replication, "WorkerClient", RotsLater)
    monkeypatch.setattr(verification, "WorkerClient", RotsLater)
    RotsLater.rotten = set()
    _store(db, job_id)
    job2, shared = _next_step(db, path)
    assert shared
    sends = shard_checkpoint(db, job2)
    assert (sends[0].actor, sends[0].args) == ("recheck", (job2,))
    assert all(s.actor == "replicate" for s in sends[1:]) and len(sends) > 1
    FakeWorker.calls.clear()
    verification.recheck_shared(db, job2)
    rehashed = {n for kind, _url, names in FakeWorker.calls if kind == "verify" for n in names}
    assert rehashed == shared
    with session_scope(db.db_url) as s:
        created = s.get(Job, job2).created_at
        assert all(c.verified_at >= created for c in s.scalars(select(ContentCopy).where(
            ContentCopy.sha256.in_(shared))))
    for send in sends[1:]:
        replication.replicate(db, *send.args)
    with session_scope(db.db_url) as s:
        FakeWorker.sizes = {c.sha256: c.content.size for c in s.scalars(select(ContentCopy))}
    FakeWorker.calls.clear()
    verification.verify_checkpoint(db, job2)
    with session_scope(db.db_url) as s:
        assert s.get(Job, job2).state == "verified"
        copies = s.scalar(select(func.count()).select_from(ContentCopy).join(Shard, Shard.sha256 == ContentCopy.sha256)
                          .join(CheckpointFile).where(CheckpointFile.checkpoint_id == s.get(Job, job2).checkpoint_id))
        detail = s.scalar(select(JobEvent.detail).where(JobEvent.job_id == job2, JobEvent.to_state == "verified"))
    assert not [c for c in FakeWorker.calls if c[0] == "verify"]  # every copy re-hashed during this store
    beside = 2 * len(shared)  # RF copies of each shared content
    assert detail == (f"{copies} copies re-hashed and matched: {copies - beside} as they were stored, "
                      f"{beside} shared with earlier checkpoints beside the uploads, 0 now")
    assert {n for kind, _url, names in FakeWorker.calls if kind == "stat" for n in names} >= shared


def test_a_shared_copy_the_recheck_finds_bad_is_left_to_the_verify_step(detected, monkeypatch):  # noqa: F811
    db, path, job_id = detected
    with session_scope(db.db_url) as s:  # a third worker, so a replacement has somewhere to go
        s.add(StorageWorker(id="w-2", url="http://127.0.0.1:7002", source="static", state="up",
                            free_bytes=10**10, capacity_bytes=10**10, last_seen=now()))
    monkeypatch.setattr(replication, "WorkerClient", RotsLater)
    monkeypatch.setattr(verification, "WorkerClient", RotsLater)
    RotsLater.rotten = set()
    _store(db, job_id)
    job2, shared = _next_step(db, path)
    rotten = sorted(shared)[0]
    RotsLater.rotten = {rotten}
    sends = shard_checkpoint(db, job2)
    verification.recheck_shared(db, job2)
    with session_scope(db.db_url) as s:
        created = s.get(Job, job2).created_at
        rows = s.scalars(select(ContentCopy).where(ContentCopy.sha256 == rotten)).all()
        assert all(c.state == "verified" and c.verified_at < created for c in rows)  # untouched: not its call
    for send in sends[1:]:
        replication.replicate(db, *send.args)
    RotsLater.rotten = set()  # the verify's own re-hash decides; here it found the copies good again
    with session_scope(db.db_url) as s:
        FakeWorker.sizes = {c.sha256: c.content.size for c in s.scalars(select(ContentCopy))}
    FakeWorker.calls.clear()
    verification.verify_checkpoint(db, job2)
    assert {n for kind, _url, names in FakeWorker.calls if kind == "verify" for n in names} == {rotten}


def test_copies_a_step_shares_are_rehashed_while_it_is_still_being_hashed(detected, monkeypatch):  # noqa: F811
    """Detection finds a shard whose content already has RF copies placed: those copies are
    re-hashed on their workers at once (pipeline.store.early), counted from when the hashing
    began, so the shard step's recheck and the verify step find nothing left to read."""
    import time

    from safetensors.torch import load_file

    from pipeline.detection import catalog, completeness
    from pipeline.store.early import EarlySends
    from tests.checkpoints import atomic_save

    db, path, job_id = detected
    monkeypatch.setattr(replication, "WorkerClient", RotsLater)
    monkeypatch.setattr(verification, "WorkerClient", RotsLater)
    RotsLater.rotten = set()
    _store(db, job_id)
    sd = load_file(path)
    for name in sorted(sd)[len(sd) // 2:]:
        sd[name] = sd[name] + 1
    step2 = atomic_save(sd, path.with_name("step_2.safetensors"))
    FakeWorker.calls.clear()
    started, queued = now(), []
    with EarlySends(db, queued.extend, "chain", started) as early:
        d = catalog.hash_checkpoint(path.parent, step2, completeness.inspect(step2), shard_size=db.shard_size,
                                    on_shard=early.shard)
    deadline = time.monotonic() + 10
    while early._rechecking and time.monotonic() < deadline:
        time.sleep(0.02)
    with session_scope(db.db_url) as s:
        _ckpt, job, _ = catalog.record(s, d, lease_seconds=60, detail="test", started_at=started)
        job2 = job.id
        shared = set(s.scalars(select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == 1))) \
            & {sha for shards in d.shards for _p, sha in shards}
        assert shared and all(c.verified_at >= started for c in s.scalars(select(ContentCopy).where(
            ContentCopy.sha256.in_(shared))))
    assert {n for kind, _url, names in FakeWorker.calls if kind == "verify" for n in names} == shared
    assert queued  # the changed half went out meanwhile
    FakeWorker.calls.clear()
    sends = shard_checkpoint(db, job2, early.sent)
    for send in sends:
        if send.actor == "recheck":
            verification.recheck_shared(db, *send.args)
        else:
            replication.replicate(db, *send.args)
    for send in queued:
        replication.replicate(db, *send.args)
    # the store's own recheck found nothing left to re-hash: only new copies were re-hashed
    assert not {n for kind, _url, names in FakeWorker.calls if kind == "verify" for n in names} & shared
    with session_scope(db.db_url) as s:
        FakeWorker.sizes = {c.sha256: c.content.size for c in s.scalars(select(ContentCopy))}
    verification.verify_checkpoint(db, job2)
    with session_scope(db.db_url) as s:
        assert s.get(Job, job2).state == "verified"
        detail = s.scalar(select(JobEvent.detail).where(JobEvent.job_id == job2, JobEvent.to_state == "verified"))
    assert detail.endswith(f"{2 * len(shared)} shared with earlier checkpoints beside the uploads, 0 now"), detail
