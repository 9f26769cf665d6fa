"""Every command finds the home of a running ``ckpt up`` from a subdirectory of its project
(the nearest ``.ckpt`` upward, as git finds its repository), and from anywhere else with
``--home`` after the command; without one, a command that only asks creates nothing and says
where it looked (pipeline/home.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.processes import FAST, KEY, descendants, stop_up, wait_for

pytestmark = pytest.mark.integration


def test_every_command_finds_the_home_from_a_subdirectory_and_from_elsewhere(tmp_path):
    project, other = tmp_path / "project", tmp_path / "elsewhere"
    sub = project / "notebooks" / "deep"
    for d in (project / "runs" / "r", sub, other):
        d.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(FAST, CKPT_CLUSTER_KEY=KEY, PYTHONUNBUFFERED="1", XDG_DATA_HOME=str(tmp_path / "user-data"),
               CKPT_WEB_PORT="0")
    up = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "up", "--root", str(project / "runs" / "*")],
                          env=env, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = [up.pid]
    home = project / ".ckpt"

    def ckpt(*args: str, cwd=sub) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=120)

    def ok(*args: str, cwd=sub) -> str:
        r = ckpt(*args, cwd=cwd)
        assert r.returncode == 0, f"ckpt {' '.join(args)} in {cwd}: {r.stdout}{r.stderr}"
        return r.stdout + r.stderr

    try:
        wait_for(lambda: (home / "up.json").exists() or up.poll() is not None, 60, "ckpt up to be ready")
        assert up.poll() is None, up.stdout.read()
        pids += descendants(up.pid)
        step = atomic_save(state_dict(0), project / "runs" / "r" / "step_1.safetensors")

        def verified() -> bool:
            rows = json.loads(ok("status", "--json"))["checkpoints"]
            return any(c["state"] == "verified" for c in rows)

        wait_for(verified, 90, "the checkpoint protected, seen from a subdirectory", interval=0.5)
        cid = str(json.loads(ok("status", "--json"))["checkpoints"][0]["id"])
        # From a subdirectory of the project: every command, with no --home and no CKPT_HOME.
        assert "already known" in ok("store", str(step), "--wait")
        restored = ok("restore", cid, "--to", "back.safetensors", "--wait")
        assert restored.count(": done") == 1 and f"done: restored to {sub / 'back.safetensors'}" in restored
        assert (sub / "back.safetensors").read_bytes() == step.read_bytes()
        assert "is pinned" in ok("pin", cid, "--note", "kept for the paper")
        assert "no longer pinned" in ok("unpin", cid)
        ok("policy")
        refused = ckpt("forget", cid, "--dry-run")  # the run's newest protected checkpoint: found, and kept
        assert refused.returncode == 1 and "is the newest protected checkpoint" in refused.stderr, refused.stderr
        ok("gc", "--dry-run")
        scrub = ok("scrub", "--wait")
        assert scrub.count(": done") == 3 and "shards checked, 0 bad" in scrub  # one line per worker, said once
        ok("dead-letters")
        ok("migrate")

        # Elsewhere: no home is found, none is made, and the error says where it looked.
        r = ckpt("status", cwd=other)
        assert r.returncode == 1 and "no ckpt home found" in r.stderr and str(other) in r.stderr, r.stderr
        assert "user-data" in r.stderr and not (other / ".ckpt").exists()
        # ... and with --home, before or after the command, everything works from there.
        assert json.loads(ok("status", "--json", "--home", str(home), cwd=other))["checkpoints"]
        ok("--home", str(home), "policy", cwd=other)
        ok("restore", cid, "--to", "again.safetensors", "--wait", "--home", str(home), cwd=other)
        assert (other / "again.safetensors").read_bytes() == step.read_bytes()
        r = ckpt("status", "--home", str(tmp_path / "nothing-here"), cwd=other)
        assert r.returncode == 1 and "no ckpt home at" in r.stderr and not (tmp_path / "nothing-here").exists()
    finally:
        stop_up(up, pids)
