"""The fork server the trainer tests start writers from (tests/writers/forkserver.py, forked.py).

Given a server (preloading nothing, or numpy, or torch where the test is about it), When a
test starts a module through it, Then the child behaves as ``python -m MODULE`` started by
``subprocess.Popen`` would: its exit status, its environment, directory, argv, sys.path and
descriptors, signals, and its end with the server's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import alive, children_of, wait_for
from tests.writers import forked
from tests.writers.forked import ForkServer, ForkServerError

REPO = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, "-m", "tests.unit.forked_child"]


@pytest.fixture(scope="module")
def server():
    s = ForkServer(()).start()
    try:
        yield s
    finally:
        s.stop()


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def both(server: ForkServer, *args: str, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The same command forked and as a plain subprocess: (returncode, stdout, stderr) of each."""
    kwargs.setdefault("env", env())
    kwargs.setdefault("cwd", REPO)
    results = []
    for p in (server.popen([*CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs),
              subprocess.Popen([*CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)):
        out, err = p.communicate(timeout=60)
        results.append(subprocess.CompletedProcess(args, p.returncode, out, err))
    return results[0], results[1]


@pytest.mark.parametrize("args,code", [(("exit", "0"), 0), (("exit", "3"), 3), (("exit", "-1"), 255),
                                       (("message",), 1), (("raise",), 1), (("interrupt",), -signal.SIGINT)])
def test_a_child_exits_with_the_status_python_m_would(server, args, code):
    fork, plain = both(server, *args)
    assert fork.returncode == plain.returncode == code
    if args[0] in ("raise", "interrupt"):
        assert fork.stderr.startswith("Traceback (most recent call last):\n")
        assert "forkserver.py" not in fork.stderr  # the module's traceback, not the server's frames
        assert fork.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1]
    else:
        assert fork.stderr == plain.stderr


@pytest.mark.parametrize("unbuffered", [True, False])
def test_the_environment_is_replaced_and_cwd_argv_and_path_are_a_fresh_ones(server, tmp_path, unbuffered):
    only = {"PYTHONPATH": str(REPO), "ONLY_THIS": "yes", "PATH": os.environ["PATH"],
            **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})}
    fork, plain = both(server, "show", "x", env=only, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert fork.returncode == plain.returncode == 0, fork.stderr
    got, want = json.loads(fork.stdout), json.loads(plain.stdout)
    assert got["env"] == only  # nothing of the server's or the test's own environment
    assert got["cwd"] == str(tmp_path)
    assert got["argv"] == want["argv"] == [str(REPO / "tests" / "unit" / "forked_child.py"), "show", "x"]
    assert got["path"] == want["path"]
    assert got["unbuffered"] is want["unbuffered"] is unbuffered
    assert got["stdin"] == want["stdin"] == ""
    assert got["fds"] == want["fds"]  # none of the server's sockets, as close_fds


def test_the_child_reads_and_writes_the_descriptors_the_caller_gave(server, tmp_path):
    with open(tmp_path / "out", "w") as out:
        p = server.popen([*CHILD, "echo"], env=env(), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
        assert p.communicate(input=b"hello", timeout=30) == (None, None)
    assert p.returncode == 0
    assert (tmp_path / "out").read_text() == "out hello\nerr hello\n"
    p = server.popen([*CHILD, "echo"], env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    assert p.communicate("text", timeout=30) == ("out text\n", "err text\n")


def test_the_pid_is_the_servers_child_and_a_signal_or_a_kill_by_pid_is_reported_as_popen_does(server):
    p = server.popen([*CHILD, "sleep", "60"], env=env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "sleeping\n"
    assert p.pid in children_of(server.pid)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.terminate()
    assert p.wait(timeout=10) == -signal.SIGTERM
    p.kill()  # once it ended: nothing, as Popen
    assert p.returncode == -signal.SIGTERM
    p.stdout.close()

    i = server.popen([*CHILD, "sleep", "60"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert i.stdout.readline() == "sleeping\n"
    i.send_signal(signal.SIGINT)  # Ctrl-C: KeyboardInterrupt, as in a fresh interpreter (the server ignores it)
    _, err = i.communicate(timeout=10)
    assert i.returncode == -signal.SIGINT and err.splitlines()[-1] == "KeyboardInterrupt", err

    q = server.popen([*CHILD, "sleep", "60"], env=env(), stdout=subprocess.PIPE, text=True)
    assert q.stdout.readline() == "sleeping\n"
    os.kill(q.pid, signal.SIGKILL)
    assert q.wait(timeout=10) == -signal.SIGKILL
    q.stdout.close()
    wait_for(lambda: not children_of(server.pid), 10, "the server to reap its children")


def test_exit_waits_for_the_childs_threads_and_pools_and_runs_its_atexit_functions_once(server):
    fork, plain = both(server, "exit-late")
    assert fork.returncode == 0, fork.stderr
    assert fork.stdout == plain.stdout == "main done\nthread done\npool done\natexit\n"


def test_a_missing_directory_raises_in_the_caller_as_popen_does(server, tmp_path):
    with pytest.raises(FileNotFoundError):
        server.popen([*CHILD, "exit", "0"], env=env(), cwd=tmp_path / "nowhere")


def test_stop_ends_the_server_and_every_child_it_forked():
    s = ForkServer(()).start()
    p = s.popen([*CHILD, "sleep", "60"], env=env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "sleeping\n"
    s.stop()
    assert s.proc.returncode == 0
    assert not alive(p.pid)
    assert p.wait(timeout=5) == -signal.SIGKILL
    p.stdout.close()


def test_the_servers_death_kills_its_children():
    s = ForkServer(()).start()
    try:
        p = s.popen([*CHILD, "sleep", "60"], env=env(), stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "sleeping\n"
        os.kill(s.pid, signal.SIGKILL)
        wait_for(lambda: not alive(p.pid), 10, "the child to die with its server")
        assert p.wait(timeout=5) == -signal.SIGKILL
        p.stdout.close()
    finally:
        s.stop()


def test_the_server_and_its_children_die_with_the_test_process(tmp_path):
    """Even while a process the test forked holds its end of the server's socket open."""
    script = ("import os, subprocess, sys, time\n"
              "from tests.writers.forked import ForkServer\n"
              "s = ForkServer(()).start()\n"
              f"p = s.popen({CHILD + ['sleep', '60']!r}, stdout=subprocess.PIPE, text=True)\n"
              "p.stdout.readline()\n"
              "fork = os.fork()\n"
              "if fork == 0:\n"
              "    time.sleep(60)\n"
              "    os._exit(0)\n"
              "print(s.pid, p.pid, fork, flush=True)\n"
              "time.sleep(60)\n")
    test = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env(), stdout=subprocess.PIPE, text=True)
    forked_pid = None
    try:
        server_pid, child_pid, forked_pid = map(int, test.stdout.readline().split())
        assert alive(server_pid) and alive(child_pid)
        test.kill()
        test.wait()
        wait_for(lambda: not alive(server_pid) and not alive(child_pid), 10, "the server and its child to die")
    finally:
        test.kill()
        test.wait()
        test.stdout.close()
        if forked_pid is not None and alive(forked_pid):
            os.kill(forked_pid, signal.SIGKILL)


def test_a_preloaded_librarys_thread_is_stopped_before_each_fork_and_the_child_uses_it():
    """numpy's OpenBLAS starts a thread at import (on a machine with more than one core) and
    stops it before a fork (pthread_atfork); the server forks with one thread. numpy.random
    (the trainers' preload imports it) seeded its generator at import: each child reseeds."""
    s = ForkServer(("numpy.random",)).start()
    try:
        draws = set()
        for _ in range(2):
            p = s.popen([*CHILD, "numpy"], env=env(), stdout=subprocess.PIPE, text=True)
            product, draw = p.communicate(timeout=60)[0].split()
            assert p.returncode == 0 and float(product) == 300.0 ** 3
            assert os.listdir(f"/proc/{s.pid}/task") == [str(s.pid)]
            draws.add(draw)
        assert len(draws) == 2  # numpy's global generator seeded per process, as in fresh ones
    finally:
        s.stop()


def test_a_preload_that_imports_pipeline_is_refused():
    with pytest.raises(ForkServerError, match="afresh under its own environment"):
        ForkServer(("pipeline.settings",)).start()


def test_popen_forks_when_only_what_the_child_applies_differs_and_starts_a_subprocess_otherwise(server,
                                                                                                 monkeypatch):
    monkeypatch.setattr(forked, "_server", server)
    same = forked.popen([*CHILD, "exit", "4"], env={**server.env, "CKPT_HOME": "/x", "XDG_DATA_HOME": "/y"})
    assert isinstance(same, forked.Forked) and same.wait(30) == 4
    other = forked.popen([*CHILD, "exit", "5"], env={**server.env, "OMP_NUM_THREADS": "7"})
    assert isinstance(other, subprocess.Popen) and other.wait(30) == 5


def test_popen_starts_a_subprocess_where_the_server_cannot_start(monkeypatch):
    monkeypatch.setattr(forked, "PRELOAD", ("no_such_library_here",))
    monkeypatch.setattr(forked, "_server", None)
    monkeypatch.setattr(forked, "_unavailable", None)
    with pytest.warns(UserWarning, match="No module named 'no_such_library_here'"):
        r = forked.run([*CHILD, "exit", "6"], env=env())
    assert r.returncode == 6
    assert forked._server is None  # not tried again: the next writer starts as a plain one at once


def test_run_kills_the_child_at_its_timeout(server, monkeypatch):
    monkeypatch.setattr(forked, "_server", server)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([*CHILD, "sleep", "60"], env=env(), capture_output=True, timeout=0.5)
    assert time.monotonic() - started < 10
    wait_for(lambda: not children_of(server.pid), 10, "the killed child to be reaped")


def test_a_writer_forked_after_transformers_writes_through_the_slow_disk(tmp_path):
    """tests.writers.slow replaces safetensors' save_file after transformers bound it (preloaded),
    and transformers' saves still pause: the writer matrix's slow disk holds for forked writers."""
    s = ForkServer(("transformers.modeling_utils",)).start()
    try:
        r = s.popen([*CHILD, "slow-save", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env=env(CKPT_SLOW_ROOT=str(tmp_path), CKPT_SLOW_BEFORE="1"))
        out, err = r.communicate(timeout=120)
        assert r.returncode == 0, err
        seconds, torch_own_save = out.split()
        assert float(seconds) >= 1.0  # paused before the weights file, as in a fresh process
        assert torch_own_save == "save"  # torch's own names left as a fresh process leaves them
    finally:
        s.stop()


def env_writer(tmp_path: Path) -> dict[str, str]:
    """A library that sets one variable and removes another when imported; an environment
    that finds it (and holds the variable it removes)."""
    (tmp_path / "sets_env_at_import.py").write_text(
        "import os\nos.environ['SET_AT_IMPORT'] = 'yes'\nos.environ.pop('DROPPED_AT_IMPORT', None)\n")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", "DROPPED_AT_IMPORT": "1"}


def shown_env(p) -> dict[str, str]:
    return json.loads(p.communicate(timeout=60)[0])["env"]


def test_what_a_preloaded_library_writes_to_the_environment_at_import_the_child_has(tmp_path):
    """Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK=1 when imported (so that torch's CUDA check
    does not poison later forks), transformers' Trainer torch inductor's TORCHINDUCTOR_CACHE_DIR:
    a fresh process that imports them has them in its environment, and so do the processes it
    starts. A child whose environment is replaced by the request's after the server imported them
    lost them, its libraries imported all the same."""
    base = env_writer(tmp_path)
    s = ForkServer(("sets_env_at_import",), env=base).start()
    try:
        got = shown_env(s.popen([*CHILD, "show"], env=base, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                text=True))
    finally:
        s.stop()
    code = "import json, os, sets_env_at_import; print(json.dumps(dict(os.environ)))"
    fresh = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=60,
                           check=True)
    want = json.loads(fresh.stdout)
    assert got.get("SET_AT_IMPORT") == want["SET_AT_IMPORT"] == "yes"
    assert "DROPPED_AT_IMPORT" not in got and "DROPPED_AT_IMPORT" not in want


def test_a_writer_started_after_the_test_process_imported_the_libraries_is_still_forked(tmp_path, monkeypatch):
    """The test process imports a preloaded library itself after its server started (with -n 0,
    tests/integration/test_trainer_metrics.py trains a transformers Trainer in-process between the
    writer modules): its environment, and every later writer's (tests.processes.base_env copies
    it), holds what the import wrote, which a fresh import leaves as it is. Those writers are
    forked as before, not every one a plain subprocess for the rest of the session; a value of
    the request's own (not the one the import writes) still gets a plain subprocess."""
    base = env_writer(tmp_path)
    s = ForkServer(("sets_env_at_import",), env=base).start()
    monkeypatch.setattr(forked, "_server", s)
    try:
        imported_here = {k: v for k, v in base.items() if k != "DROPPED_AT_IMPORT"} | {"SET_AT_IMPORT": "yes"}
        p = forked.popen([*CHILD, "show"], env=imported_here, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         text=True)
        assert isinstance(p, forked.Forked)
        got = shown_env(p)
        assert got.get("SET_AT_IMPORT") == "yes" and "DROPPED_AT_IMPORT" not in got
        own = forked.popen([*CHILD, "exit", "0"], env={**base, "SET_AT_IMPORT": "mine"})
        assert isinstance(own, subprocess.Popen) and own.wait(30) == 0
    finally:
        s.stop()
