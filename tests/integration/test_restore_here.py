"""A restore that its caller waits for runs in the caller's process (pipeline.operations.restore_here),
or for ``ckpt restore``, in the one ``ckpt up``'s command server forked for it
(pipeline/service/commands.py), and an attempt that fails there is taken over by the host's
Dramatiq worker."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import Cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    d = tmp_path_factory.mktemp("failpoints")
    (d / "trace").touch()  # every failpoint reached is written there, with its process id
    return d


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, points):
    c = Cluster(tmp_path_factory.mktemp("here"), env={"CKPT_FAILPOINTS": str(points)})
    try:
        yield c.start()
    finally:
        c.stop()


def protected(cluster: Cluster, name: str, seed: int) -> Path:
    run = cluster.runs / "run"
    run.mkdir(exist_ok=True)
    path = atomic_save(state_dict(seed, layers=4, width=64), run / name)
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))
    return path


def writers(points: Path, point: str) -> set[int]:
    """The processes that reached failpoint ``point`` so far."""
    return {int(line.split()[1]) for line in (points / "trace").read_text().splitlines() if line.split()[0] == point}


def run(cluster: Cluster, *argv: str) -> tuple[int, subprocess.CompletedProcess]:
    """(pid, its result) of a process run with the cluster's environment."""
    proc = subprocess.Popen(list(argv), env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # a test that fails leaves no process behind
        proc.communicate()
        raise
    return proc.pid, subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_ckpt_restore_wait_writes_the_file_in_its_own_process(cluster, points, tmp_path):
    path = protected(cluster, "step_1.safetensors", 1)
    before = writers(points, "restore.write")
    dest = tmp_path / "restored.safetensors"
    pid, r = run(cluster, sys.executable, "-m", "pipeline.cli", "restore", str(path), "--to", str(dest), "--wait")
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == path.read_bytes()
    assert writers(points, "restore.write") - before == {cluster.ran_as(pid)}  # no Dramatiq worker wrote any of it


def test_python_restore_waited_for_runs_in_the_calling_process(cluster, points, tmp_path):
    path = protected(cluster, "step_2.safetensors", 2)
    before = writers(points, "restore.write")
    dest = tmp_path / "restored.safetensors"
    pid, r = run(cluster, sys.executable, "-c", f"import pipeline; pipeline.restore({str(path)!r}, {str(dest)!r})")
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == path.read_bytes()
    assert writers(points, "restore.write") - before == {pid}


def test_an_attempt_that_fails_in_the_command_is_finished_by_the_dramatiq_worker(cluster, points, tmp_path):
    path = protected(cluster, "step_3.safetensors", 3)
    (points / "restore.write").write_text("raise\n")  # fires once: in the first process to write
    dest = tmp_path / "restored.safetensors"
    pid, r = run(cluster, sys.executable, "-m", "pipeline.cli", "restore", str(path), "--to", str(dest), "--wait")
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == path.read_bytes()
    assert f"pid {cluster.ran_as(pid)} " in (points / "restore.write.fired").read_text()  # it failed in the command
    assert set(cluster.dramatiq_workers()) & writers(points, "restore.write")  # and a worker wrote it then
    assert not [p for p in tmp_path.iterdir() if p.name != dest.name]  # the failed attempt's staging is gone
    assert "FailpointError" in (cluster.job(int(r.stdout.split("restore job ")[1].split(":")[0])).last_error or "")
