"""``ckpt restore`` and ``ckpt status`` run by ``ckpt up``'s command server (pipeline/service/commands.py):
the same output, exit status and files as run in the caller's process, the caller's signals
forwarded, and run in the caller's process whenever a forked child would not run as it would."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import Cluster, alive, wait_for

pytestmark = pytest.mark.integration

CKPT = (sys.executable, "-m", "pipeline.cli")


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    return tmp_path_factory.mktemp("failpoints")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, points):
    c = Cluster(tmp_path_factory.mktemp("warm"), env={"CKPT_FAILPOINTS": str(points)})
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def stored(cluster) -> Path:
    run = cluster.runs / "run"
    run.mkdir(exist_ok=True)
    path = atomic_save(state_dict(7, layers=4, width=64), run / "step_1.safetensors")
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))
    return path


def served(cluster: Cluster) -> dict[int, int]:
    return cluster.served()


def refusals(cluster: Cluster) -> list[str]:
    return [line for line in (cluster.home / "logs" / "commands.log").read_text().splitlines()
            if "runs its command itself" in line]


def run(cluster: Cluster, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        prefix: tuple[str, ...] = ()) -> tuple[int, subprocess.CompletedProcess]:
    proc = subprocess.Popen([*prefix, *CKPT, *args], env=env or cluster.env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.pid, subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_status_is_served_and_says_what_it_says_in_the_callers_process(cluster, stored):
    def same() -> bool:  # the cluster may still be settling (its workers' used bytes): until it says the same
        pid, warm = run(cluster, "status")
        _, cold = run(cluster, "status", env={**cluster.env, "CKPT_WARM": "0"})
        assert warm.returncode == cold.returncode == 0, warm.stderr + cold.stderr
        assert pid in served(cluster) and "step_1.safetensors" in warm.stdout
        return warm.stdout == cold.stdout and warm.stderr == cold.stderr

    wait_for(same, 60, "the same status served and in the caller's process", interval=0.5)


def test_a_served_restore_is_byte_identical_into_a_path_relative_to_the_callers_directory(cluster, stored,
                                                                                          tmp_path):
    pid, r = run(cluster, "restore", str(stored), "--to", "restored.safetensors", "--wait", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "restored.safetensors").read_bytes() == stored.read_bytes()
    assert "done: restored to" in r.stderr  # the progress, as in the caller's process
    assert pid in served(cluster)


def test_errors_and_usage_end_as_in_the_callers_process(cluster, stored, tmp_path):
    pid, missing = run(cluster, "restore", "999999", "--to", str(tmp_path / "x"), "--wait")
    assert missing.returncode == 1 and "no checkpoint '999999'" in missing.stderr
    assert pid in served(cluster)
    pid, usage = run(cluster, "status", "--no-such-flag")
    assert usage.returncode == 2 and "unrecognized arguments: --no-such-flag" in usage.stderr
    assert pid in served(cluster)


def test_ctrl_c_reaches_the_served_restore_which_ends_as_the_callers_would(cluster, stored, points, tmp_path):
    # The write pauses on a fetch thread, which the interrupted restore waits for (as in the caller's process).
    (points / "restore.write").write_text("sleep 3\n")
    proc = subprocess.Popen([*CKPT, "restore", str(stored), "--to", str(tmp_path / "r"), "--wait"], env=cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (points / "restore.write.fired").exists(), 60, "the restore to write")
        child = served(cluster)[proc.pid]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        (points / "restore.write.fired").unlink(missing_ok=True)
    assert proc.returncode == -signal.SIGINT, err  # as Python ends on Ctrl-C
    assert "KeyboardInterrupt" in err
    wait_for(lambda: not alive(child), 10, f"served restore pid {child} to end")
    # As in the caller's own process, the interrupted attempt hands the job to the host's Dramatiq worker.
    job = int(out.split("restore job ", 1)[1].split(":", 1)[0])
    assert cluster.wait_job(job, ("done",)).state == "done"
    assert (tmp_path / "r").read_bytes() == stored.read_bytes()


def test_a_caller_killed_outright_takes_its_served_command_with_it(cluster, stored, points, tmp_path):
    (points / "restore.write").write_text("sleep 60\n")
    proc = subprocess.Popen([*CKPT, "restore", str(stored), "--to", str(tmp_path / "r"), "--wait"], env=cluster.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (points / "restore.write.fired").exists(), 60, "the restore to write")
        child = served(cluster)[proc.pid]
        assert f"pid {child} " in (points / "restore.write.fired").read_text()
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not alive(child), 10, f"served restore pid {child} to end with its caller")
    finally:
        if proc.poll() is None:
            proc.kill()
        for name in ("restore.write", "restore.write.fired"):
            (points / name).unlink(missing_ok=True)


@pytest.mark.parametrize("change, reason", [
    ({"PYTHONHASHSEED": "123"}, "another PYTHONHASHSEED"),
    ({"CKPT_FAILPOINTS": ""}, "another CKPT_FAILPOINTS"),
])
def test_a_caller_started_otherwise_runs_its_command_itself(cluster, stored, change, reason):
    pid, r = run(cluster, "status", env={**cluster.env, **change})
    assert r.returncode == 0 and "step_1.safetensors" in r.stdout, r.stderr
    assert pid not in served(cluster)
    assert any(f"pid {pid} runs its command itself: {reason}" in line for line in refusals(cluster))


def test_a_caller_at_a_lower_priority_runs_its_command_itself(cluster, stored):
    pid, r = run(cluster, "status", prefix=("nice", "-n", "5"))
    assert r.returncode == 0 and "step_1.safetensors" in r.stdout, r.stderr
    assert pid not in served(cluster)
    assert any(f"pid {pid} runs its command itself: another priority" in line for line in refusals(cluster))


def test_other_commands_and_python_callers_run_in_their_own_process(cluster, stored):
    pid, r = run(cluster, "policy")
    assert r.returncode == 0, r.stderr
    assert pid not in served(cluster)
    code = "import sys; from pipeline.cli.main import main; sys.exit(main(['status']))"
    proc = subprocess.run([sys.executable, "-c", code], env=cluster.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "step_1.safetensors" in proc.stdout, proc.stderr
    assert len(served(cluster)) == len(set(served(cluster)))  # and nothing new was served for it
    assert not any("import sys" in line for line in (cluster.home / "logs" / "commands.log").read_text().splitlines())


def test_changed_code_is_never_run_stale(cluster, stored):
    """The server notices a module it imported changed, sends the caller away and ends; ckpt up
    starts it again, on the new code."""
    server = cluster.up_info()["children"]["commands"]
    module = Path(sys.modules["pipeline"].__file__).parent / "status.py"
    before = os.stat(module)
    try:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        pid, r = run(cluster, "status")
        assert r.returncode == 0 and "step_1.safetensors" in r.stdout, r.stderr
        assert pid not in served(cluster)
        assert any(f"pid {pid} runs its command itself: the code changed" in line for line in refusals(cluster))
    finally:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))
    wait_for(lambda: cluster.up_info()["children"]["commands"] != server, 30, "the command server to restart")

    def served_again() -> bool:
        # A server started before the file was put back saw it changed once more: it refuses and
        # restarts too. Whatever it refuses, it is for that reason only.
        pid, r = run(cluster, "status")
        assert r.returncode == 0 and "step_1.safetensors" in r.stdout, r.stderr
        if pid in served(cluster):
            return True
        assert any(f"pid {pid} runs its command itself: the code changed" in line
                   or f"pid {pid} " not in line for line in refusals(cluster))
        return False

    wait_for(served_again, 60, "a command served by the restarted server", interval=0.5)
