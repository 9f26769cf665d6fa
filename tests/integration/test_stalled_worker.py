"""A storage worker that stalls (SIGSTOP) while a whole cluster stores through chains: the
store goes on, its copies re-placed, within seconds of the stall timeout; only the stalled
worker is marked down, never a healthy hop before it in a chain."""
from __future__ import annotations

import contextlib
import os
import signal

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy, JobEvent, StorageWorker
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job

pytestmark = pytest.mark.integration


def test_a_stalled_worker_is_the_only_one_marked_and_the_store_goes_on(make_cluster):
    # 4 workers, RF 3: every content's chain is 3 of the 4, so the stalled one is first, middle or
    # last in most. Probes never mark it (down only after 600 s unseen): what marks it is the
    # evidence of the chains.
    cluster = make_cluster(workers=4, env={
        "CKPT_RF": "3", "CKPT_REPLICATION": "chain", "CKPT_STALL_SECONDS": "2", "CKPT_PROBE_SECONDS": "1",
        "CKPT_WORKER_DOWN_SECONDS": "600", "CKPT_SCRUB_CRON": "", "CKPT_GC_CRON": ""})
    stalled = cluster.workers[2]
    healthy = {w.node_id for w in cluster.workers if w is not stalled}
    run = cluster.runs / "run"
    run.mkdir()
    pids = stalled.pids()
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        path = atomic_save(state_dict(7, layers=16, width=256), run / "step_1.safetensors")
        cluster.wait_job(checkpoint_job(cluster, path), ("verified", "rotated", "protected"), timeout=180)
        with session_scope(cluster.settings.db_url) as s:
            states = {w.id: w.state for w in s.scalars(select(StorageWorker))}
            notes = [d for d in s.scalars(select(JobEvent.detail)) if d and "unreachable" in d]
            # An upload sent early (while detection still hashes the file, before its store job
            # exists: no job to note it on) may be the one that finds the stall; the copy it
            # gave up keeps the evidence.
            given_up = [e for e in s.scalars(select(ContentCopy.last_error).where(
                ContentCopy.worker_id == stalled.node_id, ContentCopy.state == "abandoned")) if e]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert states[stalled.node_id] == "down"
    assert {w: states[w] for w in healthy} == dict.fromkeys(healthy, "up")
    assert all(f"worker {stalled.node_id} unreachable" in n for n in notes), notes
    evidence = notes + given_up
    assert any("through the chain" in e for e in evidence), evidence  # named by the hop before it
    per_content: dict[str, set[str]] = {}
    for worker, sha, _seq in cluster.copies(path):
        per_content.setdefault(sha, set()).add(worker)
    assert per_content and all(ws == healthy for ws in per_content.values()), per_content
