"""``ckpt workers`` against a real cluster: a drain followed to its end while the copies move,
removal refused while the worker answers, then done once it is stopped; ``ckpt status``'s one line."""
from __future__ import annotations

import re

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job

pytestmark = pytest.mark.integration


def test_drain_wait_remove_and_the_compact_status(make_cluster):
    cluster = make_cluster(workers=3, env={"CKPT_SCRUB_CRON": ""})
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(4), run / "step_1.safetensors")
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))
    node = cluster.copies(path)[0][0]

    listed = cluster.cli("workers")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:] if line.startswith("w-")}
    assert set(rows) == {w.node_id for w in cluster.workers} and all(r[1] == "up" for r in rows.values())
    size = r"[\d.,]+ (bytes|kB|MB|GB|TB)"
    assert re.search(rf"\bw-\w+\s+up\s+-\s+{size}\s+{size}\s+[1-9]\d*\s+", listed.stdout), listed.stdout

    status = cluster.cli("status")
    lines = status.stdout.splitlines()
    assert lines[0].startswith("cluster: healthy | 3 of 3 storage worker(s) up |"), status.stdout
    assert re.split(r"\s{2,}", lines[2]) == [str(run.resolve()), "step_1.safetensors verified", "1/1", "-"]

    drained = cluster.cli("workers", "drain", node, "--wait", "--timeout", "120", timeout=150)
    assert drained.returncode == 0, drained.stdout + drained.stderr + cluster.logs()
    progress = re.findall(r"(\d+) of (\d+) content\(s\) \(.*\) still to copy elsewhere", drained.stdout)
    assert progress and int(progress[0][0]) > 0, drained.stdout  # it started with copies to make
    assert f"storage worker {node} is drained (removable)" in drained.stdout
    shard_rf: dict[str, int] = {}
    for w, sha, _seq in cluster.copies(path):
        if w != node:
            shard_rf[sha] = shard_rf.get(sha, 0) + 1
    assert min(shard_rf.values()) >= 2  # every shard has RF copies without the drained worker

    refused = cluster.cli("workers", "remove", node)
    assert refused.returncode == 1 and f"{node} still answers at" in refused.stderr, refused.stdout + refused.stderr
    cluster.worker(node).stop()
    removed = cluster.cli("workers", "remove", node)
    assert removed.returncode == 0, removed.stderr
    assert f"storage worker {node} (removable, " in removed.stdout
    assert node not in cluster.cli("workers").stdout
    gone = cluster.cli("workers", "undrain", node)
    assert gone.returncode == 1 and f"no worker {node}; `ckpt workers` lists them" in gone.stderr
