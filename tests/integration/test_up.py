"""`ckpt up` runs the whole system with its own local workers and leaves no process behind."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.processes import FAST, alive, base_env, descendants, has_loaded, stop_up, wait_for

pytestmark = pytest.mark.integration


def start_up(tmp_path, *extra: str) -> tuple[subprocess.Popen, dict]:
    env = base_env(tmp_path / "home")
    env.update(FAST)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "up", "--root", str(tmp_path / "runs" / "*"),
                             "--workers", "3", *extra], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    info_path = tmp_path / "home" / "up.json"
    try:
        wait_for(lambda: info_path.exists() or proc.poll() is not None, 60, "ckpt up to be ready")
        assert proc.poll() is None, proc.stdout.read()
    except BaseException:
        proc.kill()
        raise
    return proc, json.loads(info_path.read_text())


def all_pids(proc: subprocess.Popen) -> list[int]:
    return [proc.pid, *descendants(proc.pid)]


def test_ckpt_up_protects_a_checkpoint_and_stops_everything_on_ctrl_c(tmp_path):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    proc, info = start_up(tmp_path)
    pids = all_pids(proc)
    try:
        assert len(info["workers"]) == 3 and set(info["children"]) >= {"redis", "dramatiq", "scheduler", "watcher"}
        # up.json (it may hold a database password) and the logs (they echo URLs): this user's only
        private = [tmp_path / "home" / "up.json", *(tmp_path / "home" / "logs").glob("*.log")]
        assert len(private) > 5 and {oct(stat.S_IMODE(p.stat().st_mode)) for p in private} == {"0o600"}
        atomic_save(state_dict(0), tmp_path / "runs" / "r" / "step_1.safetensors")
        env = base_env(tmp_path / "home")

        def verified() -> bool:
            out = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--json"], env=env,
                                 capture_output=True, text=True).stdout
            return any(c["state"] == "verified" for c in json.loads(out)["checkpoints"])

        wait_for(verified, 90, "the checkpoint to be verified", interval=0.5)
        # On one host every copy crossed loopback as it is: no process loaded the planes codec's
        # numpy (pipeline/service/warmth.py loads it ahead only where frames are coming).
        assert [p for p in all_pids(proc) if has_loaded(p, "numpy")] == []
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "ckpt up: stopping" in out
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not [p for p in pids if alive(p)], 20, "every child to exit")
    assert not (tmp_path / "home" / "up.json").exists()
    # The command server removed its socket (it compared the listener's inode, never the file's).
    assert not (tmp_path / "home" / "run" / "commands.sock").exists()


def test_children_die_with_a_killed_ckpt_up(tmp_path):
    (tmp_path / "runs").mkdir()
    proc, _info = start_up(tmp_path)
    pids = all_pids(proc)
    assert len(pids) >= 8
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        wait_for(lambda: not [p for p in pids if alive(p)], 30, "orphans to exit after their parent died")
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_dramatiq_workers_die_with_a_killed_master(tmp_path):
    """SIGKILL of the Dramatiq master (the OOM killer's usual pick) must not leave its worker
    processes consuming for ever beside the master `ckpt up` starts next."""
    (tmp_path / "runs").mkdir()
    proc, info = start_up(tmp_path)
    pids = all_pids(proc)
    try:
        master = info["children"]["dramatiq"]
        workers = descendants(master)
        assert len(workers) >= 2
        os.kill(master, signal.SIGKILL)
        wait_for(lambda: not [p for p in workers if alive(p)], 15, "the dead master's worker processes to exit")
        up_json = tmp_path / "home" / "up.json"
        wait_for(lambda: json.loads(up_json.read_text())["children"]["dramatiq"] != master, 30,
                 "ckpt up to start a new dramatiq master")
    finally:
        stop_up(proc, pids)
