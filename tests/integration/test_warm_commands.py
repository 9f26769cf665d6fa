"""``ckpt restore`` and ``ckpt status`` run by ``ckpt up``'s command server (pipeline/service/commands.py):
the same output, exit status and files as run in the caller's process, the caller's signals
forwarded, and run in the caller's process whenever a forked child would not run as it would."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
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
        c.start()
        # Started once the services are ready (pipeline/service/supervisor.py): listening a moment later.
        wait_for(lambda: (c.home / "run" / "commands.sock").exists(), 60, "the command server")
        yield c
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


def interactive() -> None:
    """A caller as a shell starts it in the foreground: no signal ignored or blocked. A test process
    may have either from an earlier test, and what it starts inherits them (a command then ignores
    Ctrl-C or Ctrl-Z, served or not: the served child takes the caller's)."""
    for sig in (signal.SIGINT, signal.SIGTSTP, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGCONT):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


@contextlib.contextmanager
def held_restore(cluster: Cluster, stored: Path, points: Path, dest: Path, preexec=interactive):
    """A served restore paused for 3 s at its first write: (its caller, the child running it)."""
    (points / "restore.write").write_text("sleep 3\n")  # on a fetch thread, which the restore waits for
    proc = subprocess.Popen([*CKPT, "restore", str(stored), "--to", str(dest), "--wait"], env=cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    try:
        wait_for(lambda: (points / "restore.write.fired").exists(), 60, "the restore to write")
        child = served(cluster)[proc.pid]
        assert f"pid {child} " in (points / "restore.write.fired").read_text()
        yield proc, child
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for name in ("restore.write", "restore.write.fired"):
            (points / name).unlink(missing_ok=True)


def test_ctrl_c_reaches_the_served_restore_which_ends_as_the_callers_would(cluster, stored, points, tmp_path):
    with held_restore(cluster, stored, points, tmp_path / "r") as (proc, child):
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT, err  # as Python ends on Ctrl-C
    assert "KeyboardInterrupt" in err
    wait_for(lambda: not alive(child), 10, f"served restore pid {child} to end")
    # As in the caller's own process, the interrupted attempt hands the job to the host's Dramatiq worker.
    job = int(out.split("restore job ", 1)[1].split(":", 1)[0])
    assert cluster.wait_job(job, ("done",)).state == "done"
    assert (tmp_path / "r").read_bytes() == stored.read_bytes()


def settled(cluster: Cluster, out: str) -> None:
    """A restore whose process was killed is re-driven once its lease ends: wait for it, so that it
    never reaches a failpoint a later test arms."""
    job = int(out.split("restore job ", 1)[1].split(":", 1)[0])
    assert cluster.wait_job(job, ("done",)).state == "done"


def test_a_caller_killed_outright_takes_its_served_command_with_it(cluster, stored, points, tmp_path):
    with held_restore(cluster, stored, points, tmp_path / "r") as (proc, child):
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        wait_for(lambda: not alive(child), 10, f"served restore pid {child} to end with its caller")
    settled(cluster, out)


@pytest.mark.parametrize("change, reason", [
    ({"PYTHONHASHSEED": "123"}, "another PYTHONHASHSEED"),
    ({"CKPT_FAILPOINTS": ""}, "another CKPT_FAILPOINTS"),
    ({"LD_PRELOAD": ""}, "another LD_PRELOAD"),  # the loader's (faketime, torsocks): read only at exec
])
def test_a_caller_started_otherwise_runs_its_command_itself(cluster, stored, change, reason):
    pid, r = run(cluster, "status", env={**cluster.env, **change})
    assert r.returncode == 0 and "step_1.safetensors" in r.stdout, r.stderr
    assert pid not in served(cluster)
    assert any(f"pid {pid} runs its command itself: {reason}" in line for line in refusals(cluster))


@pytest.mark.parametrize("prefix, reason", [
    (("nice", "-n", "5"), "another priority"),
    (("chrt", "--batch", "0"), "another priority"),
    (("taskset", "-c", "0"), "another Cpus_allowed_list"),
])
def test_a_caller_scheduled_otherwise_runs_its_command_itself(cluster, stored, prefix, reason):
    pid, r = run(cluster, "status", prefix=prefix)
    assert r.returncode == 0 and "step_1.safetensors" in r.stdout, r.stderr
    # The wrapper exec'd the command: same pid.
    assert pid not in served(cluster)
    assert any(f"pid {pid} runs its command itself: {reason}" in line for line in refusals(cluster))


def test_interpreter_options_are_the_servers_or_it_runs_itself(cluster, stored):
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-m", "pipeline.cli", "status"],
                          env=cluster.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "step_1.safetensors" in proc.stdout, proc.stderr
    assert any("runs its command itself: another warnoptions" in line for line in refusals(cluster))


def test_a_closed_standard_stream_runs_the_command_itself(cluster, stored):
    before = dict(served(cluster))
    proc = subprocess.run([*CKPT, "status"], env=cluster.env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.close(0))
    assert proc.returncode == 0 and "step_1.safetensors" in proc.stdout, proc.stderr
    assert served(cluster) == before


def test_a_caller_that_ignores_hangups_keeps_its_served_restore_through_one(cluster, stored, points, tmp_path):
    """nohup: SIGHUP ignored by the caller is ignored by its command too."""
    def nohup() -> None:
        interactive()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    with held_restore(cluster, stored, points, tmp_path / "r", preexec=nohup) as (proc, child):
        proc.send_signal(signal.SIGHUP)
        os.kill(child, signal.SIGHUP)  # the terminal's hangup reaches whatever it reaches: nothing ends
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (tmp_path / "r").read_bytes() == stored.read_bytes()


def test_a_caller_started_with_ctrl_c_ignored_runs_on_through_one(cluster, stored, points, tmp_path):
    """`ckpt restore ... &` in a script: the shell starts it with SIGINT ignored; served, too."""
    with held_restore(cluster, stored, points, tmp_path / "r",
                      preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) as (proc, child):
        proc.send_signal(signal.SIGINT)
        os.kill(child, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (tmp_path / "r").read_bytes() == stored.read_bytes()


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def test_a_suspended_caller_killed_outright_takes_its_stopped_command_with_it(cluster, stored, points, tmp_path):
    """Ctrl-Z stops the command with its caller (the caller SIGSTOPs it: done here as it does, since
    the kernel discards a Ctrl-Z's default stop in an orphaned process group, as a test's may be);
    a caller then killed leaves no stopped command behind: the server sees it go."""
    with held_restore(cluster, stored, points, tmp_path / "r") as (proc, child):
        os.kill(child, signal.SIGSTOP)
        wait_for(lambda: stopped(child), 10, "the command to stop")
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        wait_for(lambda: not alive(child), 10, f"stopped command pid {child} to end with its caller")
    settled(cluster, out)


def test_a_signal_sent_the_moment_the_child_exists_ends_it_and_never_the_server(cluster, stored):
    """A Ctrl-C forwarded at once, before the child reset what it inherited from the server."""
    server = cluster.up_info()["children"]["commands"]
    # This process is the caller: Ctrl-C neither ignored nor blocked here, or the child takes that.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        _signal_the_moment_the_child_exists(cluster)
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert cluster.up_info()["children"]["commands"] == server and alive(server)


def _signal_the_moment_the_child_exists(cluster: Cluster) -> None:
    from pipeline.cli.warm import MESSAGE, request_of

    for _ in range(10):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(30)
            run_dir = os.open(cluster.home / "run", os.O_PATH | os.O_DIRECTORY)
            try:
                sock.connect(f"/proc/self/fd/{run_dir}/commands.sock")  # a pytest path may be too long
            finally:
                os.close(run_dir)
            sock.send(json.dumps({**json.loads(request_of(["status"])), "env": cluster.env}).encode())
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE, 1)
            assert "pid" in json.loads(data), data
            signal.pidfd_send_signal(fds[0], signal.SIGINT)
            os.close(fds[0])
            cwd = os.open(".", os.O_PATH | os.O_DIRECTORY)
            with open(os.devnull, "w") as null:
                socket.send_fds(sock, [b"go"], [0, null.fileno(), null.fileno(), cwd])
            os.close(cwd)
            assert json.loads(sock.recv(MESSAGE)) == {"signal": signal.SIGINT}


def test_a_served_command_killed_outright_ends_its_caller_the_same_way(cluster, stored, points, tmp_path):
    with held_restore(cluster, stored, points, tmp_path / "r") as (proc, child):
        os.kill(child, signal.SIGKILL)  # the OOM killer's way
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err
    assert "Traceback" not in err
    settled(cluster, out)


def test_a_suspended_command_survives_its_server_and_is_still_interruptible(cluster, stored, points, tmp_path):
    """Ctrl-Z, the server killed (its children are in sessions of their own: never hung up), then
    fg; and a Ctrl-C with no server left to say how the command ended: the child says it."""
    with held_restore(cluster, stored, points, tmp_path / "r") as (proc, child):
        os.kill(child, signal.SIGSTOP)  # what the caller does on Ctrl-Z (see above)
        wait_for(lambda: stopped(child), 10, "the command to stop")
        server = cluster.up_info()["children"]["commands"]
        os.kill(server, signal.SIGKILL)
        wait_for(lambda: cluster.up_info()["children"]["commands"] != server, 30, "ckpt up to start a new server")
        time.sleep(1)
        assert alive(child)
        os.kill(child, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (tmp_path / "r").read_bytes() == stored.read_bytes()
    with held_restore(cluster, stored, points, tmp_path / "r2") as (proc, child):
        os.kill(cluster.up_info()["children"]["commands"], signal.SIGKILL)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT, err
    job = int(out.split("restore job ", 1)[1].split(":", 1)[0])
    assert cluster.wait_job(job, ("done",)).state == "done"  # handed to the Dramatiq worker, as always


def test_a_reader_that_goes_away_ends_a_served_command_as_its_own(cluster, stored):
    """PYTHONUNBUFFERED (the test environment's): the broken pipe meets the command, not its exit."""
    codes = []
    for warm in ("1", "0"):
        read, write = os.pipe()
        os.close(read)
        proc = subprocess.run([*CKPT, "status", "--verbose"], env={**cluster.env, "CKPT_WARM": warm}, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
        os.close(write)
        codes.append((proc.returncode, proc.stderr))
    assert codes[0] == codes[1], codes


@pytest.mark.parametrize("how", ["buffered", "python -u"])
def test_a_reader_gone_before_the_exit_ends_a_served_command_as_its_own(cluster, stored, how):
    """Buffered, the broken pipe meets the exit (after ``ckpt`` closed its stderr on one): exit
    120, nothing said; ``python -u`` (which sys.flags does not show) writes through: exit 0.
    A served child had died printing to the closed stderr, its caller saying "ended without
    saying how", and buffered ``-u``'s output."""
    env = {k: v for k, v in cluster.env.items() if k != "PYTHONUNBUFFERED"}
    prefix = (sys.executable, "-u", "-m", "pipeline.cli") if how == "python -u" else CKPT
    ends = []
    for warm in ("1", "0"):
        read, write = os.pipe()
        os.close(read)
        proc = subprocess.Popen([*prefix, "status", "--verbose"], env={**env, "CKPT_WARM": warm}, stdout=write,
                                stderr=subprocess.PIPE, text=True)
        os.close(write)
        _, err = proc.communicate(timeout=120)
        ends.append((proc.returncode, err))
        assert (proc.pid in served(cluster)) == (warm == "1")
    assert ends[0] == ends[1], ends


def test_a_stderr_that_cannot_be_flushed_at_exit_ends_a_served_command_as_its_own(cluster, stored):
    """Python exits 120 when stderr cannot be flushed at its exit (a full disk); so does a served command."""
    env = {k: v for k, v in cluster.env.items() if k != "PYTHONUNBUFFERED"}
    codes = []
    for warm in ("1", "0"):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([*CKPT, "status", "--no-such-flag"], env={**env, "CKPT_WARM": warm},
                                  stdout=subprocess.PIPE, stderr=full, timeout=120)
        codes.append(proc.returncode)
    assert codes == [120, 120], codes


def test_a_server_that_does_not_answer_costs_a_few_seconds_not_the_command(cluster, stored):
    server = cluster.up_info()["children"]["commands"]
    os.kill(server, signal.SIGSTOP)
    try:
        pid, r = run(cluster, "status")
    finally:
        os.kill(server, signal.SIGCONT)
    assert r.returncode == 0 and "step_1.safetensors" in r.stdout, r.stderr
    assert pid not in served(cluster)
    pid, r = run(cluster, "status")  # and it answers again, the stale request dropped
    assert r.returncode == 0 and pid in served(cluster), r.stderr


def test_a_socket_of_another_user_is_never_given_anything(tmp_path):
    """A home another user can write to (a shared scratch directory) may hold their socket: the
    command never sends it its environment, terminal or directory."""
    home = tmp_path / ".ckpt"
    run_dir = home / "run"
    run_dir.mkdir(parents=True)
    fake = (
        "import os, socket\n"
        f"s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.bind({str(run_dir / 'commands.sock')!r})\n"
        f"os.chmod({str(run_dir / 'commands.sock')!r}, 0o777)\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s.listen(8); print('ready', flush=True)\n"  # listening as that user: what its peers see
        "while True:\n"
        "    c, _ = s.accept(); c.settimeout(5)\n"
        "    try:\n"
        "        data = c.recv(1 << 20)\n"
        "    except OSError:\n"
        "        data = b''\n"
        "    print('got', len(data), flush=True)\n"
        "    c.close()\n")
    server = subprocess.Popen([sys.executable, "-c", fake], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        proc = subprocess.run([*CKPT, "--home", str(home), "status"], env={**env, "SECRET_TOKEN": "hunter2"},
                              capture_output=True, text=True, timeout=60)
        assert "Traceback" not in proc.stderr, proc.stderr
    finally:
        server.kill()
        heard = server.communicate()[0]
    # Connected to (that is how the command learns whose the socket is), never sent a byte.
    assert all(line == "got 0" for line in heard.splitlines()), heard


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
