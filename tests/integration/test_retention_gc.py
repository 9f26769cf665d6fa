"""Remote retention and garbage collection with the real processes.

Twelve steps of a run, each changing a few tensors of the one before (so steps share most of
their content), under keep-last 3 plus a pin: once `ckpt gc --wait` is done, the workers'
disks hold exactly RF copies of the content the kept checkpoints reference, every kept
checkpoint restores byte for byte, and a forgotten one is refused with a clear error.
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Content, Job, Shard
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration

STEPS = 12


def step_state(step: int) -> dict[str, torch.Tensor]:
    """The model at ``step``: layer (step % 6) and the head are retrained since the step before."""
    sd = state_dict(0, layers=6, width=96)
    g = torch.Generator().manual_seed(1000 + step)
    for s in range(1, step + 1):
        layer = s % 6
        for name in ("attn.q.weight", "mlp.up.weight"):
            key = f"layers.{layer}.{name}"
            sd[key] = torch.randn(sd[key].shape, generator=g)
        sd["lm_head.weight"] = torch.randn(sd["lm_head.weight"].shape, generator=g)
    return sd


def disk_bytes(cluster) -> int:
    return sum(p.stat().st_size for w in cluster.workers for p in (w.data / "shards").rglob("*") if p.is_file())


def test_keep_last_three_and_a_pin_then_gc_leaves_rf_copies_of_exactly_the_kept_content(make_cluster, tmp_path):
    cluster = make_cluster(env={"CKPT_REMOTE_KEEP_LAST": "3", "CKPT_GC_GRACE_SECONDS": "0"})
    run = cluster.runs / "run"
    run.mkdir()
    digests, jobs = {}, {}
    for step in range(1, STEPS + 1):
        path = atomic_save(step_state(step), run / f"step_{step:03d}.safetensors")
        digests[step] = hashlib.sha256(path.read_bytes()).hexdigest()
        jobs[step] = checkpoint_job(cluster, path)
        cluster.wait_job(jobs[step], ("verified", "rotated", "forgotten"), timeout=90)
        if step == 2:
            r = cluster.cli("pin", str(path), "--note", "the run's first eval")
            assert r.returncode == 0 and "pinned" in r.stdout, r.stderr
    kept_steps = {2, 10, 11, 12}
    ids = {step: cluster.job(j).checkpoint_id for step, j in jobs.items()}

    def forgotten() -> set[int]:
        return {step for step, j in jobs.items() if cluster.job(j).state == "forgotten"}

    wait_for(lambda: forgotten() == set(range(1, STEPS + 1)) - kept_steps, 60, "the policy to forget the rest")
    preview = cluster.cli("policy", str(run.resolve()))
    assert preview.returncode == 0 and "last 3" in preview.stdout and "pinned" in preview.stdout, preview.stdout

    dry = cluster.cli("gc", "--dry-run")
    assert dry.returncode == 0 and "would delete" in dry.stdout, dry.stdout
    before = disk_bytes(cluster)
    r = cluster.cli("gc", "--wait", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    with session_scope(cluster.settings.db_url) as s:
        kept_content = select(Shard.sha256).join(CheckpointFile).where(
            CheckpointFile.checkpoint_id.in_([ids[k] for k in kept_steps]))
        kept_bytes = sum(s.scalars(select(Content.size).where(Content.sha256.in_(kept_content))))
        everything = sum(s.scalars(select(Content.size)))
    assert kept_bytes < everything / 2  # the steps share content, and the policy dropped most of it
    after = disk_bytes(cluster)
    assert after == cluster.settings.rf * kept_bytes, (before, after, kept_bytes)
    assert after < before

    for step in sorted(kept_steps):
        dest = tmp_path / f"restored_{step}.safetensors"
        r = cluster.cli("restore", str(ids[step]), "--to", str(dest), "--wait", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        assert hashlib.sha256(dest.read_bytes()).hexdigest() == digests[step]
    refused = cluster.cli("restore", str(ids[5]), "--to", str(tmp_path / "nope"))
    assert refused.returncode == 1 and "was forgotten" in refused.stderr, refused.stderr
    assert not (tmp_path / "nope").exists()

    doc = json.loads(cluster.cli("status", "--json").stdout)
    (summary,) = [r for r in doc["runs"] if r["run"] == str(run.resolve())]
    assert summary["policy_set"] and summary["by_state"].get("forgotten") == STEPS - len(kept_steps)
    assert doc["run_usage"][str(run.resolve())]["unique"] == after
    with session_scope(cluster.settings.db_url) as s:
        pinned = s.scalar(select(Checkpoint.pin_note).where(Checkpoint.id == ids[2]))
        failed = s.scalars(select(Job.id).where(Job.state == "failed")).all()
    assert pinned == "the run's first eval" and failed == []
