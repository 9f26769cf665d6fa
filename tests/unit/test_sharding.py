"""The shard step: detection's manifest is placed without reading the files again, unless
their size or mtime moved since detection; then changed content supersedes the job."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, ContentCopy, Job, Shard, StorageWorker
from pipeline.db.transitions import now
from pipeline.detection import catalog, completeness
from pipeline.store import sharding
from tests.checkpoints import atomic_save, state_dict


def _workers(db, n: int) -> None:
    """``n`` storage workers up, with room (w-0, w-1, ...)."""
    with session_scope(db.db_url) as s:
        for i in range(n):
            s.add(StorageWorker(id=f"w-{i}", url=f"http://127.0.0.1:{7000 + i}", source="static", state="up",
                                free_bytes=10**10, capacity_bytes=10**10, last_seen=now()))


def _on_trainer(db, tmp_path, seed: int):
    """A trainer host's settings (small shards), a run and a checkpoint written in it, three workers."""
    db = dataclasses.replace(db, shard_size=16 * 1024, host="trainer-1")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    path = atomic_save(state_dict(seed), run / f"step_{seed}.safetensors")
    _workers(db, 3)
    return db, run, path


@pytest.fixture
def detected(db, tmp_path):
    """A checkpoint of several shards recorded the way the watcher records it, two workers up."""
    db = dataclasses.replace(db, shard_size=16 * 1024)
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    path = atomic_save(state_dict(1), run / "step_1.safetensors")
    d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size)
    _workers(db, 2)
    with session_scope(db.db_url) as s:
        ckpt, job, _ = catalog.record(s, d, lease_seconds=60, detail="test")
        return db, path, job.id


def shards_and_state(db, job_id):
    with session_scope(db.db_url) as s:
        job = s.get(Job, job_id)
        shards = s.query(Shard).all()
        return job.state, job.last_error, [(sh.seq, sh.sha256, len(sh.content.copies)) for sh in shards]


def test_detection_records_the_manifest_and_the_step_places_it_without_reading(db, detected, monkeypatch):
    db, path, job_id = detected
    before = shards_and_state(db, job_id)[2]
    assert len(before) > 2 and all(n == 0 for _seq, _sha, n in before)

    def no_read(*_a, **_k):
        raise AssertionError("the shard step read a file that did not change")

    monkeypatch.setattr(sharding, "scan", no_read)
    sends = sharding.shard_checkpoint(db, job_id)
    state, _err, after = shards_and_state(db, job_id)
    assert state == "sharded"
    assert [(q, h) for q, h, _n in after] == [(q, h) for q, h, _n in before]
    assert all(n == db.rf for _q, _h, n in after)
    # Chain replication (the default): one message per content, through its first copy's worker.
    assert len(sends) == len({h for _q, h, _n in after}) and all(len(send.args[1]) == db.rf - 1 for send in sends)


def test_a_touched_file_is_read_again_and_kept(db, detected):
    db, path, job_id = detected
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    sharding.shard_checkpoint(db, job_id)
    assert shards_and_state(db, job_id)[0] == "sharded"


def test_content_changed_since_detection_supersedes_the_job(db, detected):
    db, path, job_id = detected
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, new bytes (and a new mtime)
    path.write_bytes(bytes(data))
    assert sharding.shard_checkpoint(db, job_id) == []
    state, err, shards = shards_and_state(db, job_id)
    assert state == "superseded" and "content changed since detection" in err
    assert all(n == 0 for _q, _h, n in shards)


def test_a_restore_reads_from_every_worker_holding_its_shards(detected):
    """Every shard on both workers, all verified: the manifest's first choices alternate, so a
    restore reads about half the bytes from each rather than all from the first placed."""
    from sqlalchemy import update

    from pipeline.db.models import Checkpoint, ContentCopy
    from pipeline.restoring.gather import manifest

    db, path, job_id = detected
    sharding.shard_checkpoint(db, job_id)
    with session_scope(db.db_url) as s:
        s.execute(update(ContentCopy).values(state="verified", verified_at=now()))
    with session_scope(db.db_url) as s:
        (f,) = manifest(s, s.get(Checkpoint, s.get(Job, job_id).checkpoint_id))
    first = {}
    for sh in f.shards:
        assert len(sh.copies) == 2  # the other is still there to fall back on
        first[sh.copies[0][0]] = first.get(sh.copies[0][0], 0) + sh.size
    biggest = max(sh.size for sh in f.shards)
    assert set(first) == {"w-0", "w-1"} and abs(first["w-0"] - first["w-1"]) <= biggest, first


def test_a_restore_reads_an_object_store_only_after_every_worker(detected):
    """A verified copy on an object store is a restore's last source, read by the store's client
    (found by the chaos soak: a restore offered a bucket's copy first to a worker's client, and
    failed on "storage worker URL must look like http://HOST:PORT" although every shard had two
    verified copies on workers)."""
    from sqlalchemy import select, update

    from pipeline.db.models import Checkpoint
    from pipeline.restoring.gather import manifest

    db, path, job_id = detected
    sharding.shard_checkpoint(db, job_id)
    with session_scope(db.db_url) as s:
        s.execute(update(ContentCopy).values(state="verified", verified_at=now()))
        s.add(StorageWorker(id="target:store", url="s3://bucket/ckpt", source="target", tier="objectstore",
                            state="up"))
        s.flush()
        for sha in set(s.scalars(select(ContentCopy.sha256))):
            s.add(ContentCopy(sha256=sha, worker_id="target:store", state="verified", verified_at=now()))
    with session_scope(db.db_url) as s:
        (f,) = manifest(s, s.get(Checkpoint, s.get(Job, job_id).checkpoint_id))
    assert f.shards
    for sh in f.shards:
        assert [worker for worker, _url in sh.copies][-1] == "target:store"
        assert {worker for worker, _url in sh.copies[:-1]} == {"w-0", "w-1"}


def test_a_root_may_fan_out_while_the_others_chain(detected):
    """Replication is chosen per store, by the checkpoint's root: its ``replication`` option
    over CKPT_REPLICATION."""
    import json

    db, path, job_id = detected
    root = db.roots[0]
    fan = dataclasses.replace(db, root_options=json.dumps({root: {"replication": "fanout"}}))
    sends = sharding.shard_checkpoint(fan, job_id)
    with session_scope(db.db_url) as s:
        pending = s.query(ContentCopy.id).filter(ContentCopy.state == "pending").all()
        detail = s.get(Job, job_id).events[-1].detail
    assert sorted(send.args for send in sends) == sorted((i,) for (i,) in pending)  # one message per copy
    assert detail.endswith(", fanout")
    other = dataclasses.replace(db, root_options=json.dumps({"/elsewhere/*": {"replication": "fanout"}}))
    assert other.options_for(root).replication == "chain"


def test_a_roots_replication_must_be_a_mode(tmp_path):
    from pipeline.errors import ConfigError
    from pipeline.settings import load

    with pytest.raises(ConfigError, match="replication must be one of chain, fanout, got 'broadcast'"):
        load({"home": tmp_path, "root_options": '{"/r/*": {"replication": "broadcast"}}'}, environ={})


def test_shards_are_sent_as_they_are_hashed_and_the_shard_step_sends_only_the_rest(db, tmp_path):
    """Detection places and sends each shard's copies as soon as its hash is known, naming its
    place in the file (pipeline/store/early.py); the shard step then sends only the copies it
    placed itself, and routes nothing twice."""
    from pipeline.queues import host_queue, queues_for
    from pipeline.store.early import AHEAD, EarlySends
    from pipeline.store.source import named_source, source_matches

    db, run, path = _on_trainer(db, tmp_path, 1)
    queued: list = []
    early = EarlySends(db, queued.extend, "chain")
    hashed: list[str] = []

    def told(entry, plan, sha):
        hashed.append(sha)
        early.shard(entry, plan, sha)
        # this shard's upload is queued before the next is read, for the first few
        assert len(queued) == min(len(set(hashed)), AHEAD)

    d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size, on_shard=told)
    # every shard once, as it was found (from the file's start and its middle at once)
    assert len(hashed) > 2 and sorted(hashed) == sorted(sha for shards in d.shards for _p, sha in shards)
    with session_scope(db.db_url) as s:
        # The messages name the shard in the file and go to the queue of the host that has it.
        for send in queued:
            copy_id, chain, named = send.args
            assert len(chain) == db.rf - 1 and queues_for(s, send) == [host_queue("trainer-1")]
            src = named_source(named)
            assert src is not None and src.path == str(path)
            assert source_matches(src.path, src.kind, src.tensors, src.offset, src.length,
                                  s.get(ContentCopy, copy_id).sha256)
        assert s.query(ContentCopy).count() == db.rf * AHEAD == len(early.sent)
        # The first hops are spread (pipeline.core.placement.ChainBalance): each chain starts at the
        # one of its workers that had been first for the fewest bytes so far. (Which contents come
        # first varies: two places are hashed at once; so which workers were first varies too.)
        first: dict[str, int] = {}
        for send in queued:
            hops = [s.get(ContentCopy, i) for i in (send.args[0], *send.args[1])]
            assert first.get(hops[0].worker_id, 0) == min(first.get(h.worker_id, 0) for h in hops)
            first[hops[0].worker_id] = first.get(hops[0].worker_id, 0) + hops[0].content.size
        _ckpt, job, _ = catalog.record(s, d, lease_seconds=60, detail="test")
        job_id = job.id

    sends = sharding.shard_checkpoint(db, job_id, early.sent)
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == "sharded"
        assert s.get(Job, job_id).events[-1].detail.endswith(f"; {len(early.sent)} sent while hashing")
        pending = {c.id for c in s.query(ContentCopy).filter(ContentCopy.state == "pending")}
    # The shard step sends the rest, one chain per content, and none of the copies sent early.
    assert len(sends) == len(set(hashed)) - AHEAD
    sent_now = {i for send in sends for i in (send.args[0], *send.args[1])}
    assert sent_now | set(early.sent) == pending and not sent_now & set(early.sent)
    # A file that moved since it was hashed is no source: its upload waits for the recorded one.
    os.utime(path, ns=(1, 1))
    assert named_source(queued[0].args[2]) is None


def test_a_checkpoint_that_fits_in_one_shard_is_not_sent_while_hashing(db, tmp_path):
    """Sending while hashing gains nothing for a checkpoint that fits in one shard (its hash is
    done as soon as its first shard's would be) and costs the detection lane a transaction per
    content: the shard step, queued at once, places and sends all of its copies. A larger one
    is still sent while it is hashed."""
    from pipeline.detection.watcher import Watcher

    db, run, path = _on_trainer(db, tmp_path, 4)
    assert path.stat().st_size > db.shard_size
    sent: list = []
    Watcher(db, sent.extend, use_events=False).scan()
    assert [x.actor for x in sent].count("replicate") >= 1 and sent[-1].actor == "shard" and sent[-1].args[1]

    whole = dataclasses.replace(db, shard_size=64 * 1024 * 1024)
    small = atomic_save(state_dict(5), run / "step_5.safetensors")
    assert small.stat().st_size <= whole.shard_size
    sent.clear()
    Watcher(whole, sent.extend, use_events=False).scan()
    (shard,) = sent
    assert (shard.actor, shard.args[1]) == ("shard", [])
    assert sharding.shard_checkpoint(whole, shard.args[0], [])  # the shard step sends its new contents


def test_fanned_out_shards_sent_while_hashing_are_counted_as_messages(db, tmp_path):
    """Fan-out sends RF messages per content: no more than ``AHEAD`` of them are queued while
    hashing (each ties up a Dramatiq thread the shard step's message then waits for)."""
    from pipeline.store.early import AHEAD, EarlySends

    db, run, path = _on_trainer(db, tmp_path, 2)
    queued: list = []
    early = EarlySends(db, queued.extend, "fanout")
    d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size,
                                on_shard=early.shard)
    contents = {sha for shards in d.shards for _p, sha in shards}
    assert len(contents) * db.rf > AHEAD
    # whole contents only: the one that reaches the limit is sent to all its workers
    assert AHEAD <= len(queued) < AHEAD + db.rf and len(queued) % db.rf == 0
    assert all(len(send.args) == 3 and send.args[1] == [] and send.args[2]["path"] == str(path) for send in queued)
    assert sorted(send.args[0] for send in queued) == sorted(early.sent)


def test_an_upload_that_ends_while_hashing_goes_on_is_followed_by_the_next_content(db, tmp_path):
    """At most ``AHEAD`` messages are in flight while hashing; as soon as one has ended (none of
    its copies pending), the next new content found is sent (a fast link would idle otherwise),
    and nothing is sent once the hashing is over."""
    from pipeline.store import early as early_mod
    from pipeline.store.early import AHEAD, EarlySends

    db, run, path = _on_trainer(db, tmp_path, 3)
    queued: list = []
    ended: list[int] = []
    waited: list[bool] = []

    def end_one() -> None:
        """The worker answered the oldest upload still in flight: its copies are verified."""
        send = next(s for s in queued if s.args[0] not in ended)
        ids = [send.args[0], *send.args[1]]
        with session_scope(db.db_url) as s:
            for c in s.query(ContentCopy).filter(ContentCopy.id.in_(ids)):
                c.state = "verified"
        ended.append(send.args[0])

    def told(entry, plan, sha):
        early.shard(entry, plan, sha)
        if len(queued) == AHEAD and not ended:
            end_one()  # the link is fast: the first upload ends while hashing goes on
        elif len(ended) == 1 and not waited:  # this content waits for room, which there is now
            waited.append(True)
            deadline = time.monotonic() + 5
            while len(queued) == AHEAD and early._found and time.monotonic() < deadline:
                time.sleep(early_mod.POLL_SECONDS / 2)

    with EarlySends(db, queued.extend, "chain") as early:
        d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size, on_shard=told)
        contents = {sha for shards in d.shards for _p, sha in shards}
        assert len(contents) > AHEAD + 1
    # No more room opened: the rest waits for the shard step, and nothing is sent after the exit.
    assert len(queued) == AHEAD + 1
    end_one()
    time.sleep(4 * early_mod.POLL_SECONDS)
    assert len(queued) == AHEAD + 1
    with session_scope(db.db_url) as s:
        assert s.query(ContentCopy).count() == db.rf * (AHEAD + 1) == len(early.sent)


def test_an_unchanged_shard_costs_no_write_while_hashing(db, tmp_path):
    """A content that already has RF copies placed is passed over with one read: hashing a
    large, mostly unchanged checkpoint takes no write lock per shard (the record references
    its contents, once)."""
    from pipeline.db.models import Content
    from pipeline.store.early import EarlySends

    db, run, path = _on_trainer(db, tmp_path, 4)
    d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size)
    with session_scope(db.db_url) as s:
        _ckpt, job, _ = catalog.record(s, d, lease_seconds=60, detail="test")
        job_id = job.id
    assert sharding.shard_checkpoint(db, job_id)  # every content placed on RF workers
    with session_scope(db.db_url) as s:
        touched = {c.sha256: c.last_referenced_at for c in s.query(Content)}
    queued: list = []
    with EarlySends(db, queued.extend, "chain") as early:
        again = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size,
                                        on_shard=early.shard)
    assert again.shas == d.shas and queued == [] and early.sent == []
    with session_scope(db.db_url) as s:
        assert {c.sha256: c.last_referenced_at for c in s.query(Content)} == touched
        # A copy on a worker that no longer counts is not one of its RF (the rule of place()):
        # the contents it held are sent again, to another worker.
        s.get(StorageWorker, "w-0").state = "down"
        on_down = {c.sha256 for c in s.query(ContentCopy).filter(ContentCopy.worker_id == "w-0")}
    assert on_down
    with EarlySends(db, queued.extend, "fanout") as early:
        catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size,
                                on_shard=early.shard)
    with session_scope(db.db_url) as s:
        sent = [s.get(ContentCopy, cid) for cid in early.sent]
        assert sent and {c.sha256 for c in sent} <= on_down and all(c.worker_id != "w-0" for c in sent)


def test_an_object_store_copy_waits_for_a_worker_to_hold_its_content_even_one_sent_while_hashing(db, tmp_path):
    """The object-store copy of a content still on its way to workers is sent only once a worker
    holds it (the worker puts it: the trainer's link carries the bytes once), for a content sent
    while hashing too: neither the shard step nor the scheduler's sweep sends it before. (Found in
    the cluster in a box: the shard step sent the bucket copies of the contents sent early at once,
    and with no worker holding them yet the trainer put them itself, 2.0x the checkpoint on its link.)"""
    import json

    from pipeline.service.scheduler import store_sweep
    from pipeline.store.early import AHEAD, EarlySends

    db, run, path = _on_trainer(db, tmp_path, 5)
    db = dataclasses.replace(db, targets=json.dumps([{"name": "store", "url": "s3://box/ckpt", "region": "us-east-1",
                                                      "endpoint": "http://127.0.0.1:9", "addressing_style": "path"}]))
    with session_scope(db.db_url) as s:
        s.add(StorageWorker(id="target:store", url="s3://box/ckpt", source="target", tier="objectstore", state="up",
                            free_bytes=10**10, capacity_bytes=10**10, last_seen=now()))
    queued: list = []
    early = EarlySends(db, queued.extend, "chain")
    d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size,
                                on_shard=early.shard)
    assert len(early.sent) == db.rf * AHEAD
    with session_scope(db.db_url) as s:
        _ckpt, job, _ = catalog.record(s, d, lease_seconds=60, detail="test")
        job_id = job.id

    sends = sharding.shard_checkpoint(db, job_id, early.sent)
    with session_scope(db.db_url) as s:
        on_store = {c.id: c.sha256 for c in s.query(ContentCopy).filter(ContentCopy.worker_id == "target:store")}
        early_shas = {s.get(ContentCopy, send.args[0]).sha256 for send in queued}
    assert set(on_store.values()) == {sha for shards in d.shards for _p, sha in shards}  # placed, every one
    sent = {i for send in sends if send.actor == "replicate" for i in (send.args[0], *send.args[1])}
    assert not sent & set(on_store)  # every content is on its way to workers: none goes to the store yet
    assert not [send for send in store_sweep(db) if send.args[0] in on_store]

    # The first upload sent while hashing is verified: its content's store copy may go now (the
    # upload's own message sends it: pipeline.store.replication.to_stores_once_held; the sweep
    # would send it too, were that message lost).
    first = queued[0]
    with session_scope(db.db_url) as s:
        for c in s.query(ContentCopy).filter(ContentCopy.id.in_([first.args[0], *first.args[1]])):
            c.state = "verified"
        done = s.get(ContentCopy, first.args[0]).sha256
    assert done in early_shas
    swept = [send.args[0] for send in store_sweep(db) if send.args[0] in on_store]
    assert [on_store[i] for i in swept] == [done]


@pytest.mark.parametrize("over", [0, 1])
def test_a_checkpoint_of_exactly_one_shard_is_sent_by_its_shard_step_and_one_byte_more_while_hashing(
        db, tmp_path, over):
    """The early-send threshold at its edge: a save of exactly ``shard_size`` bytes fits in one
    shard (nothing sent while hashing; its shard step sends every content, none left out); with
    a shard one byte smaller, it is sent while hashed, and the shard step sends the rest."""
    from pipeline.detection.watcher import Watcher

    db, run, path = _on_trainer(db, tmp_path, 4)
    db = dataclasses.replace(db, shard_size=path.stat().st_size - over)
    sent: list = []
    Watcher(db, sent.extend, use_events=False).scan()
    shard = sent[-1]
    assert shard.actor == "shard" and {x.actor for x in sent[:-1]} <= {"replicate"}
    assert bool(shard.args[1]) == bool(over) == bool(sent[:-1])  # sent while hashing only above one shard
    rest = sharding.shard_checkpoint(db, shard.args[0], shard.args[1])
    assert rest or over  # what was not sent early, the shard step sends
    with session_scope(db.db_url) as s:
        shas = set(s.scalars(select(Shard.sha256).join(Shard.file).where(
            CheckpointFile.checkpoint_id == s.get(Job, shard.args[0]).checkpoint_id)))
        placed = set(s.scalars(select(ContentCopy.sha256).where(ContentCopy.sha256.in_(shas))))
    assert shas and placed == shas  # every content has its copies, none left out
