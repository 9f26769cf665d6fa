"""What a training team meets first (issue 29): relative paths given to ``ckpt up`` mean the same
from every directory, and the settings ``ckpt up``
runs with are what every later command sees (``<home>/effective.toml``, ``ckpt config``)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.processes import FAST, KEY, descendants, stop_up, wait_for

pytestmark = pytest.mark.integration


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(FAST, CKPT_CLUSTER_KEY=KEY, PYTHONUNBUFFERED="1", XDG_DATA_HOME=str(tmp / "user-data"), **extra)
    return env


def ckpt(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def ok(env: dict[str, str], cwd: Path, *args: str) -> str:
    r = ckpt(env, cwd, *args)
    assert r.returncode == 0, f"ckpt {' '.join(args)} in {cwd}: {r.stdout}{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Iterator[tuple[Path, dict[str, str], Path]]:
    """`ckpt up --root runs/*` (relative) in a project directory, started with retention settings
    in its own environment only; a checkpoint of run ``runs/r`` protected."""
    tmp = tmp_path_factory.mktemp("project")
    project = tmp / "project"
    (project / "runs" / "r").mkdir(parents=True)
    (project / "notebooks").mkdir()
    up_env = clean_env(tmp, CKPT_REMOTE_KEEP_LAST="2", CKPT_GC_GRACE_SECONDS="0")
    up = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "up", "--root", "runs/*"], env=up_env, cwd=project,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = [up.pid]
    home = project / ".ckpt"
    env = clean_env(tmp)  # a later shell: none of ckpt up's retention settings
    try:
        wait_for(lambda: (home / "up.json").exists() or up.poll() is not None, 60, "ckpt up to be ready")
        assert up.poll() is None, up.stdout.read()
        pids += descendants(up.pid)
        atomic_save(state_dict(0), project / "runs" / "r" / "step_1.safetensors")
        wait_for(lambda: any(c["state"] == "verified" for c in json.loads(ok(env, project, "status", "--json"))
                             ["checkpoints"]), 90, "the checkpoint protected", interval=0.5)
        yield project, env, home
    finally:
        stop_up(up, pids)


def test_relative_roots_are_absolute_and_every_command_resolves_paths_from_its_own_directory(project):
    project_dir, env, home = project
    runs, sub = project_dir / "runs", project_dir / "notebooks"
    assert json.loads((home / "up.json").read_text())["roots"] == [str(runs / "*")]
    for cwd, run in ((project_dir, "runs/r"), (sub, "../runs/r")):
        rows = json.loads(ok(env, cwd, "status", "--json", "--run", run))["checkpoints"]
        assert [c["path"] for c in rows] == [str(runs / "r" / "step_1.safetensors")], (cwd, run)
        assert ok(env, cwd, "policy", run).startswith(f"{runs / 'r'}: remote retention")
    assert "already known" in ok(env, sub, "store", "../runs/r/step_1.safetensors")
    # A root given to a later command is taken from that command's directory too.
    assert "already known" in ok(env, sub, "store", "../runs/r/step_1.safetensors", "--root", "../runs/*")


def test_later_commands_see_the_settings_ckpt_up_runs_with(project):
    project_dir, env, home = project
    sub = project_dir / "notebooks"
    assert "remote retention: last 2" in ok(env, sub, "status")
    assert ": remote retention last 2" in ok(env, sub, "policy")
    assert "released less than 0 s ago" in ok(env, sub, "gc", "--dry-run")
    lines = [" ".join(line.split()) for line in ok(env, sub, "config").splitlines()]
    assert "remote_keep_last = 2 # ckpt up (env)" in lines
    assert "gc_grace_seconds = 0.0 # ckpt up (env)" in lines
    assert "keep_last = 2 # ckpt up (default)" in lines
    assert f'roots = ["{project_dir / "runs" / "*"}"] # ckpt up (flag)' in lines
    assert 'cluster_key = "***" # ckpt up (env)' not in lines and 'cluster_key = "***" # env' in lines
    assert f'home = "{home}" # the nearest .ckpt upward' in lines
    # This command's own environment comes first.
    mine = {**env, "CKPT_GC_GRACE_SECONDS": "60"}
    assert "gc_grace_seconds = 60.0 # env" in [" ".join(line.split()) for line in ok(mine, sub, "config").splitlines()]
    record = home / "effective.toml"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600 and KEY not in record.read_text()
