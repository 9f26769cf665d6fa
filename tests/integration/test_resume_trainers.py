"""Resume end to end: a node is lost mid-training, the newest protected checkpoint comes back.

Given an HF Trainer (then a Lightning) run protected through its integration, When the run
stops after its second save and its output directory is wiped (the node is lost), Then
`ckpt restore --latest RUN` brings the newest protected checkpoint back, training resumes
from it to the end, and the final weights equal an uninterrupted run's exactly.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.processes import Cluster
from tests.writers import forked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def train(c: Cluster, *args: str) -> forked.Process:
    return forked.popen([sys.executable, "-m", "tests.writers.train", *args], cwd=REPO,
                        env={**c.env, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)


def finish(p: forked.Process, what: str) -> None:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, f"{what} failed:\n{err[-4000:]}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("resume"), env={"CKPT_KEEP_LAST": "5"})
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.mark.parametrize("trainer,newest", [("hf", "checkpoint-4"), ("lightning", "epoch_epoch=1.ckpt")])
def test_a_lost_node_resumes_from_the_newest_protected_checkpoint_bit_for_bit(cluster, tmp_path, trainer, newest):
    c = cluster
    run = c.runs / trainer
    timings = {}
    t0 = time.monotonic()
    reference = train(c, trainer, "reference", str(tmp_path / "reference.pt"))
    part = train(c, trainer, "part", str(run))
    finish(part, "the interrupted run")
    timings["train until the node is lost (protected)"] = time.monotonic() - t0
    finish(reference, "the uninterrupted run")

    shutil.rmtree(run)  # the node and its disk are gone
    run.mkdir()
    t1 = time.monotonic()
    r = c.cli("restore", "--latest", str(run), "--to", str(run / newest), "--wait", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert newest in r.stdout
    timings["ckpt restore --latest"] = time.monotonic() - t1

    t2 = time.monotonic()
    finish(train(c, trainer, "resume", str(run), str(tmp_path / "resumed.pt")), "the resumed run")
    timings["resume to the end"] = time.monotonic() - t2
    want = torch.load(tmp_path / "reference.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"{len(different)} tensors differ after resuming, e.g. {different[:3]}"
    (REPO / ".pytest_cache").mkdir(exist_ok=True)
    with open(REPO / ".pytest_cache" / "resume-timings.txt", "a") as f:
        f.write(f"{trainer}: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()) + "\n")
