"""Whether the process a record names is still the one that wrote it (pipeline/liveness.py):
a ``ckpt up`` killed outright leaves ``effective.toml`` and ``up.json`` behind, and a later,
unrelated process can get its pid (the pid counter wrapped; every container's first process
is pid 1). Real processes, in private pid namespaces where the pids are ours to hand out."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline import liveness

ROOT = Path(__file__).resolve().parents[2]


def pidns_available() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


needs_pidns = pytest.mark.skipif(not pidns_available(), reason="requires unshare --pid (root)")


def in_new_pidns(*args: str) -> list[str]:
    return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
            sys.executable, "-m", "tests.pid_reuse", *args]


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}, "PYTHONPATH": str(ROOT)}


def result(r: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout + r.stderr
    return json.loads(lines[-1][len("RESULT "):])


def assert_not_applied(r: subprocess.CompletedProcess, doc: dict, why: str) -> None:
    assert doc["rf"] == 2 and doc["source"] == "default", doc  # not the 3 the dead `ckpt up` ran with
    assert why in doc["ignored"], doc
    assert why in (doc["up_gone"] or ""), doc  # a trainer's wait ends too
    assert r.stderr.count("not applying") == 1, r.stderr  # said once, though loaded twice


@needs_pidns
def test_a_record_left_by_a_killed_ckpt_up_is_not_applied_to_a_later_process_with_its_pid(tmp_path):
    """The pid counter wrapped: the reader runs as the very pid the SIGKILLed writer had."""
    r = subprocess.run(in_new_pidns("wrap", str(tmp_path)), capture_output=True, text=True, timeout=120,
                       env=env(), cwd=ROOT)
    doc = result(r)
    assert doc["pid"] == 300  # the writer's pid
    assert_not_applied(r, doc, "(pid 300) is gone (pid 300 is now another process)")


@needs_pidns
def test_a_record_of_a_killed_containers_pid_1_is_not_applied_in_another_container(tmp_path):
    writer = subprocess.Popen(in_new_pidns("writer", str(tmp_path)), stdout=subprocess.PIPE, text=True,
                              env=env(), cwd=ROOT)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
        assert json.loads((tmp_path / "up.json").read_text())["pid"] == 1
    finally:
        writer.kill()  # unshare --kill-child: its child, pid 1 of the namespace, is SIGKILLed with it
        writer.wait()
    r = subprocess.run(in_new_pidns("reader", str(tmp_path)), capture_output=True, text=True, timeout=60,
                       env=env(), cwd=ROOT)
    doc = result(r)
    assert doc["pid"] == 1  # pid 1 again, of another namespace
    assert_not_applied(r, doc, "ran in another pid namespace")


def test_a_process_is_told_apart_from_a_later_one_with_its_pid():
    me = liveness.identity()
    assert me and liveness.gone(os.getpid(), me) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert liveness.gone(dead.pid, me) == "is gone"
    # This process's identity under another live pid (one started since): that pid is another process.
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert liveness.gone(other.pid, me) == f"is gone (pid {other.pid} is now another process)"
        assert liveness.gone(other.pid, liveness.identity(other.pid)) is None
    finally:
        other.kill()
        other.wait()
    boot, space, started = me.split(" ")
    assert liveness.gone(os.getpid(), f"{uuid.uuid4()} {space} {started}") == "is gone (the machine restarted since)"
    # A record written before identities were: the pid is all there is.
    assert liveness.gone(os.getpid(), "") is None and liveness.gone(dead.pid, "") == "is gone"
    assert not liveness.pid_alive(0) and not liveness.pid_alive(-1)
