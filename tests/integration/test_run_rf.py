"""RF per run on storage workers (``rf`` in a ``[runs."<glob>"]`` table), end to end: ``ckpt up``
with three real storage workers, the watcher, dramatiq and the scheduler.

Given the global RF 3, run ``a`` with RF 1 and run ``b`` with RF 2, When each saves two
checkpoints (keep_last 1), Then a's first checkpoint is verified and rotated with one worker
copy of each shard of its own and b's with two, and no sweep (under-replication, repair,
reconcile) adds copies to reach the global RF afterwards; the shard health of each says healthy.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.status import shard_counts
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job

pytestmark = pytest.mark.integration


def copies_per_shard(cluster, path) -> list[int]:
    """Verified worker copies of each of the checkpoint's own tensor shards."""
    return sorted(Counter(sha for _worker, sha, _seq in cluster.copies(path)).values())


def test_each_run_is_verified_and_rotated_with_its_own_rf(make_cluster):
    cluster = make_cluster(env={"CKPT_RF": "3", "CKPT_KEEP_LAST": "1",
                                "CKPT_RUN_OPTIONS": json.dumps({"*/a": {"rf": 1}, "*/b": {"rf": 2}})})
    seeds = {"a": 10, "b": 20}
    firsts = {}
    for run, seed in seeds.items():
        (cluster.runs / run).mkdir()
        old = atomic_save(state_dict(seed), cluster.runs / run / "step_1.safetensors")
        firsts[run] = (old, checkpoint_job(cluster, old))
    for run, (_old, job) in firsts.items():
        cluster.wait_job(job, ("verified", "rotated"))
        atomic_save(state_dict(seeds[run] + 1), cluster.runs / run / "step_2.safetensors")
    for old, job in firsts.values():
        cluster.wait_job(job, ("rotated",), timeout=90)
        assert not old.exists()

    time.sleep(3 * cluster.settings.tick_seconds + 1)  # sweeps ran: none topped a run up to the global RF
    a, b = copies_per_shard(cluster, firsts["a"][0]), copies_per_shard(cluster, firsts["b"][0])
    assert a and set(a) == {1}, a
    assert b and set(b) == {2}, b
    with session_scope(cluster.settings.db_url) as s:
        ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.path.in_([str(p.resolve()) for p, _ in
                                                                             firsts.values()]))))
        health = shard_counts(s, cluster.settings, ckpts)
    assert all(h["under-replicated"] == 0 and h["lost"] == 0 and h["healthy"] for h in health.values()), health
