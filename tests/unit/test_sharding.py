"""The shard step: detection's manifest is placed without reading the files again, unless
their size or mtime moved since detection; then changed content supersedes the job."""
from __future__ import annotations

import dataclasses
import os

import pytest

from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy, Job, Shard, StorageWorker
from pipeline.db.transitions import now
from pipeline.detection import catalog, completeness
from pipeline.store import sharding
from tests.checkpoints import atomic_save, state_dict


@pytest.fixture
def detected(db, tmp_path):
    """A checkpoint of several shards recorded the way the watcher records it, two workers up."""
    db = dataclasses.replace(db, shard_size=16 * 1024)
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    path = atomic_save(state_dict(1), run / "step_1.safetensors")
    d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size)
    with session_scope(db.db_url) as s:
        for i in range(2):
            s.add(StorageWorker(id=f"w-{i}", url=f"http://127.0.0.1:{7000 + i}", source="static", state="up",
                                free_bytes=10**10, capacity_bytes=10**10, last_seen=now()))
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
    from pipeline.restore.gather import manifest

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
