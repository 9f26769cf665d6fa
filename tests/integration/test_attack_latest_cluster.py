"""The newest save written sharded into the run, saved again: against the real cluster (the
watcher with file events, the store steps, ``ckpt restore --latest``). See
tests/unit/test_attack_latest.py for the unit form of each history. (Written by the attack
session; no pipeline code changed.)"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.detection.catalog import latest_store_job
from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(cluster, run: Path, code: str) -> None:
    r = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from tests.writers.write import tiny_qwen; run = Path(sys.argv[1]); " + code, str(run)],
                       cwd=REPO, env={**cluster.env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


def protected_as_on_disk(cluster, run: Path) -> bool:
    """Every file of the save on disk in the run is recorded as it is now, and verified."""
    names = [p.name for p in run.iterdir() if p.name.startswith("model")]
    with session_scope(cluster.settings.db_url) as s:
        for name in names:
            c = s.scalar(select(Checkpoint).where(Checkpoint.path == str((run / name).resolve()),
                                                  Checkpoint.current.is_(True)))
            if c is None or {f.sha256 for f in c.files} != {sha(run / name)}:
                return False
            job = latest_store_job(s, c.id)
            if job is None or job.state != "verified":
                return False
    return bool(names)


def test_restore_latest_after_the_model_is_saved_into_the_run_again_gives_the_second_save(make_cluster, tmp_path):
    """History (the unit form: test_a_resave_into_the_run_with_the_same_shard_count_is_latest_
    once_protected): ``pretrained-2/``, then the model saved sharded into the run, protected;
    trained further and saved into the run again the same way (the same shard names; the
    index byte for byte the same). Every file of the second save is recorded as it is on disk
    and verified. ``ckpt restore --latest`` names ``pretrained-2`` (the sharded group is
    passed over: its index keeps the first save's completion time, older than its new shards),
    so a resume restarts from the save before both.

    Safe: ``--latest`` restores the second save: its index and its new shards, byte for byte
    what is in the run."""
    cluster = make_cluster()
    run = cluster.runs / "hf"
    run.mkdir()
    save(cluster, run, "tiny_qwen(0).save_pretrained(run / 'pretrained-2'); "
                       "tiny_qwen(1).save_pretrained(run, max_shard_size='200KB')")
    wait_for(lambda: protected_as_on_disk(cluster, run) or None, 180, "the first sharded save protected")
    time.sleep(1.1)
    save(cluster, run, "tiny_qwen(2).save_pretrained(run, max_shard_size='200KB')")
    wait_for(lambda: protected_as_on_disk(cluster, run) or None, 180,
             "the second sharded save recorded as on disk and protected")

    dest = tmp_path / "resumed"
    dest.mkdir()
    r = cluster.cli("restore", "--latest", str(run), "--to", str(dest), "--wait", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"newest protected save of {run}: {(run / INDEX).resolve()}" in r.stdout, r.stdout
    written = {p.name: sha(p) for p in run.iterdir() if p.name.startswith("model")}
    assert {p.name: sha(p) for p in dest.iterdir()} == written
