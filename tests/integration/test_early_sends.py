"""Uploads start while detection hashes (pipeline/store/early.py): a shard is on its workers
before its checkpoint is recorded, every copy crosses once, and a file that changes while
it is hashed leaves nothing that counts."""
from __future__ import annotations

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, ContentCopy, Job, JobEvent, Shard
from pipeline.integrity import gc
from pipeline.restoring.loader import load_state_dict
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for, with_settings, worker_client

pytestmark = pytest.mark.integration


def _paused_cluster(make_cluster, tmp_path, seconds: float, slow_uploads: bool = False):
    """A cluster whose watcher pauses ``seconds`` once, right after it queued the upload of the
    first shard it hashed; with ``slow_uploads``, every upload starts 1.5 s after its worker
    said it lacks the shard (so that one sent twice would be on its way twice at once, and
    cross twice)."""
    points = tmp_path / "points"
    points.mkdir()
    (points / "early.sent").write_text(f"sleep {seconds}\n")
    if slow_uploads:
        (points / "replicate.send").write_text("always sleep 1.5\n")
    return make_cluster(env={"CKPT_FAILPOINTS": str(points)}), points


def test_a_shard_is_stored_before_its_checkpoint_is_recorded_and_each_copy_crosses_once(make_cluster, tmp_path):
    cluster, points = _paused_cluster(make_cluster, tmp_path, 4, slow_uploads=True)
    run = cluster.runs / "run"
    run.mkdir()
    # ~1 MB, 5 shards: few enough that the 8 threads of `ckpt up` take every upload at once
    path = atomic_save(state_dict(21, layers=1, width=128), run / "step_21.safetensors")
    job_id = checkpoint_job(cluster, path)
    cluster.wait_job(job_id, ("verified",))
    assert (points / "early.sent.fired").exists()

    with session_scope(cluster.settings.db_url) as s:
        recorded = s.scalar(select(JobEvent.at).where(JobEvent.job_id == job_id).order_by(JobEvent.id).limit(1))
        ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path)))
        shards = s.execute(select(Shard.sha256, Shard.size).join(CheckpointFile)
                           .where(CheckpointFile.checkpoint_id == ckpt.id)).all()
        copies = s.scalars(select(ContentCopy).where(ContentCopy.sha256.in_([sha for sha, _ in shards]))).all()
        sharded = s.scalar(select(JobEvent.detail).where(JobEvent.job_id == job_id, JobEvent.to_state == "sharded"))
    contents = dict(shards)
    assert len(contents) >= 3
    assert all(c.state == "verified" for c in copies) and len(copies) == 2 * len(contents)
    early = [c for c in copies if c.stored_at < recorded]
    assert early, f"no copy stored before the checkpoint was recorded at {recorded}"
    assert "sent while hashing" in sharded, sharded

    # Every copy crossed once: the workers took RF uploads of each content, no more.
    taken = [worker_client(w).status()["uploads"] for w in cluster.workers]
    assert sum(u.get("shards", 0) for u in taken) == len(copies), taken
    assert sum(u.get("bytes", 0) for u in taken) == 2 * sum(contents.values()), taken


def test_a_file_that_changes_while_it_is_hashed_is_recorded_only_as_it_ends(make_cluster, tmp_path):
    cluster, points = _paused_cluster(make_cluster, tmp_path, 3)
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(31, layers=8, width=128), run / "step_31.safetensors")
    wait_for(lambda: (points / "early.sent.fired").exists(), 60, "the first shard's upload while hashing")
    first = (points / "early.sent.fired").read_text()
    final = state_dict(32, layers=8, width=128)
    atomic_save(final, path)  # the trainer writes it again while the watcher is paused mid-hash

    job_id = checkpoint_job(cluster, path)
    cluster.wait_job(job_id, ("verified",))
    with session_scope(cluster.settings.db_url) as s:
        versions = s.scalars(select(Checkpoint).where(Checkpoint.path == str(path))).all()
        referenced = set(s.scalars(select(Shard.sha256)))
        sent = set(s.scalars(select(ContentCopy.sha256)))
        garbage = set(gc.garbage(s, with_settings(cluster.settings, gc_grace_seconds=0)))
    assert len(versions) == 1, "the version that changed while it was hashed was recorded"
    orphans = sent - referenced
    assert orphans, f"nothing was sent while hashing the first version ({first})"
    assert orphans <= garbage  # collected once the grace period is over
    restored = load_state_dict(str(path), cluster.settings)
    assert all(restored[k].equal(final[k]) for k in final)


def test_the_copies_a_step_shares_are_rehashed_while_it_is_being_detected(make_cluster, tmp_path):
    """Real watcher and workers: the copies a step shares with the one before are re-hashed on
    their workers as soon as detection finds them unchanged, not by the shard step's recheck.
    The watcher pauses 3 s after recording the step, before it queues the shard step: every
    shared copy was re-hashed (since the store began) before the job became ``sharded``, and
    the verify step re-hashes none of them."""
    from safetensors.torch import load_file

    points = tmp_path / "points"
    points.mkdir()
    cluster = make_cluster(env={"CKPT_FAILPOINTS": str(points)})
    run = cluster.runs / "run"
    run.mkdir()
    first = atomic_save(state_dict(41, layers=8, width=128), run / "step_41.safetensors")
    cluster.wait_job(checkpoint_job(cluster, first), ("verified",))
    sd = load_file(first)
    for name in sorted(sd)[len(sd) // 2:]:
        sd[name] = sd[name] + 1
    (points / "watch.recorded").write_text("sleep 3\n")
    second = atomic_save(sd, run / "step_42.safetensors")
    job_id = checkpoint_job(cluster, second)
    cluster.wait_job(job_id, ("verified",))
    assert (points / "watch.recorded.fired").exists()

    with session_scope(cluster.settings.db_url) as s:
        def shas(path):
            return set(s.scalars(select(Shard.sha256).join(CheckpointFile).join(Checkpoint)
                                 .where(Checkpoint.path == str(path))))
        shared = shas(first) & shas(second)
        started = s.scalar(select(Job.created_at).where(Job.id == job_id))
        sharded = s.scalar(select(JobEvent.at).where(JobEvent.job_id == job_id, JobEvent.to_state == "sharded"))
        copies = s.scalars(select(ContentCopy).where(ContentCopy.sha256.in_(shared))).all()
        detail = s.scalar(select(JobEvent.detail).where(JobEvent.job_id == job_id, JobEvent.to_state == "verified"))
    assert shared and len(copies) == 2 * len(shared)
    # (verified_at moves on only by a later re-hash: none runs between the shard step and here)
    assert all(started <= c.verified_at < sharded for c in copies), [(c.verified_at, started, sharded) for c in copies]
    assert detail.endswith(f"{len(copies)} shared with earlier checkpoints beside the uploads, 0 now"), detail
