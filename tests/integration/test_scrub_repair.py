"""Scrub finds every kind of on-disk damage; repair restores RF from copies that match."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration
QUIET = {"CKPT_SCRUB_CRON": ""}  # no nightly scrub: each test starts its own


def flip_one_bit(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(data)


def overwrite_4k(p):
    with open(p, "r+b") as f:
        f.seek(100)
        f.write(os.urandom(4096))


def truncate(p):
    os.truncate(p, p.stat().st_size // 3)


DAMAGE = [flip_one_bit, overwrite_4k, truncate, os.unlink]


def jobs(cluster, kind: str) -> list[Job]:
    with session_scope(cluster.settings.db_url) as s:
        return list(s.scalars(select(Job).where(Job.kind == kind).order_by(Job.id)))


def test_one_scrub_detects_each_kind_of_damage_and_repair_restores_rf(make_cluster):
    cluster = make_cluster(env=QUIET)
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(1, layers=8, width=128), run / "step_1.safetensors")
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))

    by_shard: dict[int, list[tuple[str, str]]] = {}
    for worker_id, sha, seq in cluster.copies(path):
        by_shard.setdefault(seq, []).append((worker_id, sha))
    victims = []
    for (_seq, reps), damage in zip(sorted(by_shard.items()), DAMAGE, strict=False):  # the first few shards
        worker_id, sha = reps[0]
        damage(cluster.worker(worker_id).shard(sha))
        victims.append((worker_id, sha, damage.__name__))

    r = cluster.cli("scrub", "--wait", timeout=120)
    assert r.returncode == 0, r.stderr + cluster.logs()
    scrubs = jobs(cluster, "scrub")
    assert len(scrubs) == 3 and all(j.state == "done" for j in scrubs)
    assert sum(j.params["bad"] for j in scrubs) == 4  # each kind of damage detected once

    def repaired(worker_id: str, sha: str) -> bool:
        p = cluster.worker(worker_id).shard(sha)
        return p.exists() and hashlib.sha256(p.read_bytes()).hexdigest() == sha

    for worker_id, sha, damage in victims:
        wait_for(lambda: repaired(worker_id, sha), 90, f"the {damage} copy to be rebuilt")
    wait_for(lambda: all(j.state == "done" for j in jobs(cluster, "repair")), 60, "repairs to finish")
    for worker_id, sha, damage in victims:
        assert not any(q.startswith(sha) for q in cluster.worker(worker_id).quarantined()), damage
    status = json.loads(cluster.cli("status", "--json").stdout)
    (c,) = status["checkpoints"]
    assert c["health"] == "healthy" and c["replicas_verified"] == 2


def test_shard_with_no_matching_copy_is_lost_and_nothing_repairs_from_a_bad_copy(make_cluster):
    cluster = make_cluster(env=QUIET)
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(2), run / "step_1.safetensors")
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))
    (w1, sha, _), (w2, sha2, _) = cluster.copies(path)[:2]
    assert sha == sha2 and w1 != w2
    flip_one_bit(cluster.worker(w1).shard(sha))
    overwrite_4k(cluster.worker(w2).shard(sha))  # both copies bad, each differently
    path.unlink()  # and the local copy is gone

    r = cluster.cli("scrub", "--wait", timeout=120)
    assert r.returncode == 0, r.stderr
    repair = wait_for(lambda: [j for j in jobs(cluster, "repair") if j.state in ("lost", "done", "failed")], 90,
                      "the repair to give its verdict")[0]
    assert repair.state == "lost" and sha[:12] in repair.last_error
    for w in (w1, w2):  # the bad copies are set aside, not deleted, and nothing took their place
        assert any(q.startswith(sha) for q in cluster.worker(w).quarantined())
        assert not cluster.worker(w).shard(sha).exists()
    out = cluster.cli("status").stdout
    assert "LOST" in out
    status = json.loads(cluster.cli("status", "--json").stdout)
    assert status["checkpoints"][0]["health"] == "lost"
