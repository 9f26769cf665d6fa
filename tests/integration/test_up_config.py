"""What a training team meets first (issue 29): relative paths given to ``ckpt up`` mean the same
from every directory, a busy web port stops ``ckpt up`` at once, and the settings ``ckpt up``
runs with are what every later command sees (``<home>/effective.toml``, ``ckpt config``)."""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import liveness
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


@contextlib.contextmanager
def other_web_ui() -> Iterator[int]:
    """An HTTP server on a free loopback port in this process: another instance's web UI."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


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
    assert "remote retention: last 2" in ok(env, sub, "status", "--verbose")
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
    # Both files name the running `ckpt up` by pid and identity: a later process that gets its pid
    # after a `kill -9` is not taken for it (tests/unit/test_liveness.py).
    up = json.loads((home / "up.json").read_text())
    assert up["process"] and up["process"] == liveness.identity(up["pid"])
    assert tomllib.loads(record.read_text())["process"] == up["process"]


def test_a_busy_web_port_stops_ckpt_up_at_once(tmp_path):
    (tmp_path / "runs").mkdir()
    env = clean_env(tmp_path)
    with other_web_ui() as port:
        started = time.monotonic()
        up = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "up", "--root", "runs/*", "--web-port", str(port)],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = up.communicate(timeout=30)
        finally:
            if up.poll() is None:
                for p in [up.pid, *descendants(up.pid)]:
                    os.kill(p, signal.SIGKILL)
        assert up.returncode != 0 and time.monotonic() - started < 20, out
        assert f"port {port} is in use (by pid {os.getpid()}): pass --web-port" in out, out
        assert "ready" not in out
        assert not (tmp_path / ".ckpt" / "up.json").exists()


def test_ckpt_up_is_not_ready_while_another_process_answers_on_its_web_port(tmp_path):
    """The port taken between the check and the web UI's bind: gunicorn retries, then exits.
    The answer on the port is the other process's: never "ready"; the exit is a failure."""
    from pipeline.errors import ConfigError
    from pipeline.service.supervisor import Child, Supervisor
    from pipeline.settings import load

    with other_web_ui() as port:
        s = load({"home": tmp_path, "web_port": port, "roots": (str(tmp_path / "runs"),)}, environ={})
        sup = Supervisor(s, processes=0)
        web = Child("web", [sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(1)"],
                    dict(os.environ), tmp_path / "web.log")
        web.start()
        sup.children.append(web)
        try:
            with pytest.raises(ConfigError, match=f"port {port} is in use \\(by pid {os.getpid()}\\)"):
                sup._wait_ready(timeout=20)
        finally:
            sup.shutdown()
