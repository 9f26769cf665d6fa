"""The trainer integrations never stop training, whatever happens to the tool.

Given a real HF Trainer (then Lightning) run saving every 2 steps through its integration,
When ``ckpt up`` is SIGKILLed after the first save, or the run is outside the watched
roots, or no ckpt home can be found, Then training completes all its steps, the real cause
is printed once (not once per save), and where a home exists ``ckpt status`` shows the run as
"protection degraded". With the system running, the callbacks say where they protect and
every save is protected (verified) as before.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import Cluster, base_env, descendants, wait_for
from tests.writers import forked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
TRAINERS = ("hf", "lightning")


def train(env: dict[str, str], trainer: str, run: Path, *extra: str, cwd: Path = REPO) -> forked.Process:
    return forked.popen([sys.executable, "-m", "tests.writers.protected", trainer, str(run), *extra], cwd=cwd,
                        env={**env, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(p: forked.Process) -> tuple[dict, str]:
    """The run's summary line and its stderr, once it exited 0 with all its steps."""
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, f"training died:\n{err[-4000:]}"
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["steps"] == 8, doc
    return doc, err


def ckpt_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ckpt:")]


def said_once(err: str, *words: str) -> str:
    hits = [line for line in ckpt_lines(err) if all(w in line for w in words)]
    assert len(hits) == 1, f"expected one line with {words}, got {len(hits)}:\n" + "\n".join(ckpt_lines(err))
    return hits[0]


def status_line(c_env: dict[str, str], run: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "status"], env=c_env, capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if f"run {run}: protection degraded since" in line]
    assert lines, r.stdout
    return lines[0]


def kill_up(c: Cluster) -> None:
    """SIGKILL ``ckpt up`` and every process under it (its Redis, Dramatiq, watcher...), as a
    crash would; the storage workers are the test's and stay."""
    pids = [c.up_proc.pid, *descendants(c.up_proc.pid)]
    c.known_pids.update(pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    c.up_proc.wait()


@pytest.mark.parametrize("trainer", TRAINERS)
def test_training_completes_when_ckpt_up_is_killed_under_it(make_cluster, tmp_path, trainer):
    c = make_cluster()
    run, gate = c.runs / trainer, tmp_path / "gate"
    run.mkdir()
    gate.mkdir()
    p = train(c.env, trainer, run, str(gate))
    try:
        wait_for(lambda: (gate / "saved").exists() or p.poll() is not None, 240, "the first save to be protected")
        assert p.poll() is None, p.communicate()[1][-4000:]
        kill_up(c)
    finally:
        (gate / "go").write_text("go")
    _doc, err = finished(p)
    said_once(err, "ckpt: protecting runs under", str(c.home))
    line = said_once(err, f"protection of {run} degraded")
    assert "broker" in line and "is `ckpt up` running?" in line, line
    assert "3 failure(s)" in status_line(c.env, run)  # the saves after the kill, counted, said once


@pytest.mark.parametrize("trainer", TRAINERS)
def test_training_completes_when_the_run_is_outside_the_watched_roots(shared_cluster, tmp_path, trainer):
    c = shared_cluster
    run = tmp_path / "elsewhere" / trainer
    run.mkdir(parents=True)
    _doc, err = finished(train(c.env, trainer, run))
    line = said_once(err, f"protection of {run} degraded")
    assert "is not a checkpoint in a run under a watched root of home" in line and str(c.runs / "*") in line, line
    assert "none configured" not in err
    assert "degraded since" in status_line(c.env, run)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_training_completes_when_no_home_can_be_found(tmp_path, trainer):
    env = base_env(tmp_path / "unused")
    del env["CKPT_HOME"]
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")  # no user default home either
    run = tmp_path / "run"
    run.mkdir()
    _doc, err = finished(train(env, trainer, run, cwd=tmp_path))
    line = said_once(err, "ckpt:")
    assert f"not protecting {run} through the trainer: no ckpt home found" in line and "CKPT_HOME" in line, line
    assert not (tmp_path / ".ckpt").exists() and not (tmp_path / "xdg").exists()  # no home was made up


@pytest.mark.parametrize("trainer", TRAINERS)
def test_with_the_system_running_every_save_is_protected_and_said_so(shared_cluster, trainer):
    c = shared_cluster
    run = c.runs / f"ok-{trainer}"
    run.mkdir()
    doc, err = finished(train({**c.env, "CKPT_TEST_WAIT_LAST": "1"}, trainer, run))
    assert ckpt_lines(err) == [f"ckpt: protecting runs under {c.runs / '*'} via home {c.home}"], err[-3000:]
    import pipeline

    assert pipeline.wait_protected(doc["saves"][-1], timeout=60, settings=c.settings).protected


def test_saves_are_recorded_by_a_child_process_below_training_as_are_the_services(shared_cluster, monkeypatch):
    """The trainer's process never hashes a save: its recorder, a child at nice +10 and the
    lowest best-effort I/O class, does; so do ``ckpt up``'s services (docs/design.md,
    "Background priority")."""
    from pipeline import api, priority
    from pipeline.protector import Protector
    from pipeline.recorder import Recorder
    from tests.checkpoints import atomic_save, state_dict

    c = shared_cluster
    below = priority.Priority(10, ("best-effort", 7))
    services = c.up_info()["children"]
    assert {"dramatiq", "scheduler", "watcher"} <= set(services)
    # The command server forks the user's own commands, at the user's priority (pipeline/service/commands.py).
    assert priority.of_process(services.pop("commands")) == priority.of_process(c.up_proc.pid)
    assert {name: priority.of_process(pid) for name, pid in services.items()} == dict.fromkeys(services, below)

    def in_the_trainer(path, s):
        raise AssertionError("recorded in the trainer's own process")

    monkeypatch.setattr(api, "record", in_the_trainer)
    run = c.runs / "recorder"
    run.mkdir()
    path = run / "step_1.safetensors"
    atomic_save(state_dict(1), path)
    recorder = Recorder()
    protector = Protector(recorder)
    assert protector.declare(path, c.settings).result(120).path == str(path)
    [child] = recorder._children.values()
    assert child.proc.pid != os.getpid() and priority.of_process(child.proc.pid) == below
    child.close()
    assert child.proc.wait(30) == 0  # its stdin closed (the trainer gone): it ends
