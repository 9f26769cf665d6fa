"""torch is optional: a virtual environment without it runs `ckpt up`, stores and restores.

Given a fresh venv where only ckpt-pipeline (no extras) is installed, When `ckpt up` runs
there and a checkpoint appears, Then it is protected and restored byte for byte, torch is
not importable in that venv, and `load_state_dict` says which extra it needs.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.processes import alive, base_env, descendants, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("no-torch") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    r = subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "-c", str(REPO / "constraints.txt"), "-e", str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return path


def test_a_venv_without_torch_protects_and_restores(venv, tmp_path):
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    home, runs = tmp_path / "home", tmp_path / "runs"
    (runs / "r").mkdir(parents=True)
    env = base_env(home, CKPT_ROOTS=str(runs / "*"), CKPT_RESTORE_ROOTS=str(tmp_path))  # restored beside the runs
    env.pop("PYTHONPATH", None)
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([str(venv / "bin" / "ckpt"), "up", "--workers", "2", "--processes", "1"], env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (home / "up.json").exists() or up.poll() is not None, 120, "ckpt up in the venv")
        assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        pids = [up.pid, *descendants(up.pid)]
        src = atomic_save(state_dict(4), runs / "r" / "step_4.safetensors")

        def protected() -> bool:
            r = subprocess.run([py, "-m", "pipeline.cli", "status", "--json"], env=env, capture_output=True,
                               text=True)
            doc = json.loads(r.stdout) if r.returncode == 0 else {"checkpoints": []}
            return any(c["state"] == "verified" for c in doc["checkpoints"])

        wait_for(protected, 90, "the checkpoint protected by the torch-less system", interval=0.5)
        dest = tmp_path / "back.safetensors"
        r = subprocess.run([py, "-m", "pipeline.cli", "restore", str(src), "--to", str(dest), "--wait"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert dest.read_bytes() == src.read_bytes()
        r = subprocess.run([py, "-c", f"import pipeline; pipeline.load_state_dict({str(src)!r})"], env=env,
                           capture_output=True, text=True)
        assert r.returncode != 0 and "ckpt-pipeline[torch]" in r.stderr, r.stderr[-2000:]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    left = [p for p in pids if alive(p)]
    assert not left, f"processes outlived ckpt up: {left}"


def test_installing_into_an_environment_with_torch_keeps_its_torch(tmp_path):
    """pip resolves the torch extra to the torch already installed: nothing to download or replace."""
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
                        "--report", str(report), "-e", f"{REPO}[torch,transformers,lightning]"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    to_install = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "torch" not in to_install, to_install
