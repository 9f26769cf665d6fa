"""Writers forked from a preloaded server, handled as subprocesses (the test side of the fork server).

``popen`` and ``run`` take ``[sys.executable, "-m", MODULE, *ARGS]`` and the keyword arguments
the tests give ``subprocess.Popen`` (cwd, env, stdin, stdout, stderr, text) and return what
``subprocess`` would; the process is a child of this test process's fork server
(tests/writers/forkserver.py), started on first use and stopped at the session's end
(tests/conftest.py), when a fork gives the same process as ``python -m``. Otherwise it is a plain
subprocess: where the server cannot start (an environment without torch), from a thread other
than the main one before the server started (it dies with the thread that started it), and for
an environment that differs from the server's in a variable the preloaded libraries may have read
at import.
"""
from __future__ import annotations

import io
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tests.writers.forkserver import receive, send

REPO = Path(__file__).resolve().parents[2]
#: What the trainers and writers import before their first step (tests/writers/*.py).
PRELOAD = ("torch", "safetensors.torch", "transformers.trainer", "transformers.models.qwen2.modeling_qwen2",
           "accelerate", "lightning", "lightning.pytorch")
#: Environment variables a forked child applies as a fresh interpreter would: the preloaded
#: libraries do not read them at import (pipeline's, pytest's, the home lookup's), or the child
#: applies them itself (PYTHONPATH, PYTHONUNBUFFERED). Any other difference from the server's
#: environment sends the request to a plain subprocess.
AFTER_FORK = ("PYTHONPATH", "PYTHONUNBUFFERED", "XDG_DATA_HOME", "PYTEST_CURRENT_TEST")
AFTER_FORK_PREFIX = "CKPT_"


class ForkServerError(Exception):
    """Raised when the fork server cannot start, or dies under a request."""


class ForkServer:
    """One preloaded server for this test process: start it, fork writers from it, stop it."""

    def __init__(self, preload: Sequence[str] = PRELOAD, *, env: Mapping[str, str] | None = None,
                 timeout: float = 120) -> None:
        self.preload, self.timeout = tuple(preload), timeout
        base = os.environ if env is None else env
        self.env = {k: v for k, v in base.items() if not k.startswith(AFTER_FORK_PREFIX)}
        self.proc: subprocess.Popen[bytes] | None = None
        self.threads = 0
        #: What the preloaded libraries wrote to the environment as they were imported: each
        #: variable's value before and after (None: unset).
        self.imported: dict[str, tuple[str | None, str | None]] = {}
        self._control: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ForkServer:
        """Start it and wait until it has imported ``preload``; ForkServerError if it cannot."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.writers.forkserver", str(os.getpid()), str(theirs.fileno()),
                 ",".join(self.preload)], cwd=REPO, env=self.env, pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
            theirs.close()
            ours.settimeout(self.timeout)
            try:
                ready, _ = receive(ours)
            except TimeoutError:
                ready = None
            if ready is None:
                self.proc.kill()
                self.proc.wait()
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                ours.close()
                raise ForkServerError(f"the fork server did not start (exit status {self.proc.returncode}):\n{tail}")
        finally:
            theirs.close()
            log.close()
        ours.settimeout(None)
        self._control, self.threads = ours, ready["threads"]
        self.imported = {k: (was, now) for k, (was, now) in ready["imported"].items()}
        return self

    def takes(self, env: Mapping[str, str]) -> bool:
        """Whether a child forked here sees the environment ``env`` as a fresh interpreter would."""
        def read_at_import(e: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if not k.startswith(AFTER_FORK_PREFIX) and k not in AFTER_FORK}

        # A variable holding what a preloaded library writes to it at import (the test process
        # imported it too: transformers' Trainer, in a test that trains in-process) is as good as
        # the value it wrote over: importing it again leaves it so (its writes are fixed points).
        before = dict(env)
        for name, (was, now) in self.imported.items():
            if before.get(name) == now:
                before.pop(name, None)
                if was is not None:
                    before[name] = was
        return read_at_import(before) == read_at_import(self.env)

    def popen(self, argv: Sequence[str], *, cwd: str | os.PathLike[str] | None = None,
              env: Mapping[str, str] | None = None, stdin: Any = None, stdout: Any = None, stderr: Any = None,
              text: bool = False) -> Forked:
        """``subprocess.Popen(argv, ...)`` for ``argv = [sys.executable, "-m", MODULE, *ARGS]``."""
        module, args = _module(argv)
        return Forked(self, list(argv), module, args, cwd=os.path.abspath(cwd or os.getcwd()),
                      env=dict(os.environ if env is None else env), stdio=(stdin, stdout, stderr), text=text)

    def _request(self, doc: dict[str, Any], fds: Sequence[int]) -> None:
        if self._control is None:
            raise ForkServerError("the fork server is stopped")
        try:
            with self._lock:
                send(self._control, doc, fds)
        except OSError as e:
            raise ForkServerError(f"the fork server (pid {self.pid}) is gone: {e}") from e

    def stop(self) -> None:
        """End the server; it SIGKILLs and reaps every child still running. If it does not end
        within 10 s, SIGKILL it (by pid: it is this process's unreaped child): the children die
        with it."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _module(argv: Sequence[str]) -> tuple[str, list[str]]:
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        raise ValueError(f"not [sys.executable, '-m', MODULE, ...]: {list(argv)}")
    return argv[2], list(argv[3:])


class Forked:
    """A child of the fork server, handled as a ``subprocess.Popen`` (pid, poll, wait,
    returncode, send_signal/terminate/kill, communicate, stdin/stdout/stderr pipes)."""

    def __init__(self, server: ForkServer, argv: list[str], module: str, args: list[str], *, cwd: str,
                 env: dict[str, str], stdio: tuple[Any, Any, Any], text: bool) -> None:
        self.args, self.text = argv, text
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self._chunks: dict[int, list[bytes]] = {}
        theirs, close = self._stdio(*stdio)
        conn, conn_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server._request({"module": module, "args": args, "cwd": cwd, "env": env},
                            [conn_theirs.fileno(), *theirs])
        finally:
            conn_theirs.close()
            for fd in close:
                os.close(fd)
        self._conn = conn
        reply, _ = receive(conn)
        if reply is None:
            raise ForkServerError("the fork server died under a request")
        if "error" in reply:
            raise OSError(*reply["error"])
        self.pid: int = reply["pid"]

    def _stdio(self, stdin: Any, stdout: Any, stderr: Any) -> tuple[list[int], list[int]]:
        """The child's three descriptors, and which of them this process opened (closed once sent)."""
        theirs: list[int] = []
        close: list[int] = []
        for fd, spec in enumerate((stdin, stdout, stderr)):
            if spec is None:
                theirs.append(fd)
            elif spec == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_RDWR))
                close.append(theirs[-1])
            elif spec == subprocess.PIPE:
                r, w = os.pipe()
                mine, child = (w, r) if fd == 0 else (r, w)
                theirs.append(child)
                close.append(child)
                wrapped = os.fdopen(mine, ("w" if fd == 0 else "r") + ("" if self.text else "b"))
                if fd == 0:
                    self.stdin = wrapped
                elif fd == 1:
                    self.stdout = wrapped
                else:
                    self.stderr = wrapped
            elif spec == subprocess.STDOUT and fd == 2:
                theirs.append(theirs[1])
            elif isinstance(spec, int):
                theirs.append(spec)
            else:
                theirs.append(spec.fileno())
        return theirs, close

    def _receive(self, timeout: float | None) -> bool:
        """Read one message from the server within ``timeout``; False if none came."""
        self._conn.settimeout(timeout)
        try:
            msg, _ = receive(self._conn)
        except (TimeoutError, BlockingIOError):
            return False
        except OSError:
            msg = None
        if msg is None:  # the server died: its PR_SET_PDEATHSIG killed the child
            self.returncode = -signal.SIGKILL
        elif "status" in msg:
            self.returncode = os.waitstatus_to_exitcode(msg["status"])
        if self.returncode is not None:
            self._conn.close()
        return True

    def poll(self) -> int | None:
        while self.returncode is None and self._receive(0):
            pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._receive(left) and deadline is not None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child through the server's pidfd; nothing once it has been reaped."""
        if self.poll() is not None:
            return
        send(self._conn, {"signal": int(sig)})
        while self.returncode is None:  # until the server says it signalled (or the child's end comes first)
            self._conn.settimeout(None)
            try:
                msg, _ = receive(self._conn)
            except OSError:
                msg = None
            if msg is None:
                self.returncode = -signal.SIGKILL
            elif "status" in msg:
                self.returncode = os.waitstatus_to_exitcode(msg["status"])
            elif "signalled" in msg:
                return

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input``, read stdout and stderr to their end, wait: as Popen.communicate
        (TimeoutExpired keeps what was read for the next call)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        pending = memoryview((input.encode() if self.text else input) if input else b"")
        if self.stdin is not None:
            if pending:
                self.stdin.flush()
                sel.register(self.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                self.stdin.close()
        for f in (self.stdout, self.stderr):
            if f is not None and not f.closed:
                self._chunks.setdefault(f.fileno(), [])
                sel.register(f.fileno(), selectors.EVENT_READ)
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            for key, _ in sel.select(left):
                if key.events & selectors.EVENT_WRITE:
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fd)
                        assert self.stdin is not None
                        self.stdin.close()
                    continue
                data = os.read(key.fd, 65536)
                if data:
                    self._chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
        outputs: list[Any] = []
        for f in (self.stdout, self.stderr):
            if f is None:
                outputs.append(None)
                continue
            data = b"".join(self._chunks.get(f.fileno(), [])) if not f.closed else b""
            if isinstance(f, io.TextIOWrapper):  # as Popen: the pipe's encoding, universal newlines
                outputs.append(data.decode(f.encoding, f.errors or "strict").replace("\r\n", "\n").replace("\r", "\n"))
            else:
                outputs.append(data)
            f.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return outputs[0], outputs[1]


# --- one server per test process, started on first use -----------------------------------------

_server: ForkServer | None = None
_unavailable: str | None = None


def shared() -> ForkServer | None:
    """This test process's server, started on first use; None where it cannot start."""
    global _server, _unavailable
    # Started from the main thread only: the server dies when the thread that started it ends.
    if _server is None and _unavailable is None and threading.current_thread() is threading.main_thread():
        try:
            _server = ForkServer(PRELOAD).start()
        except ForkServerError as e:
            _unavailable = str(e)
            warnings.warn(f"writers start as plain subprocesses in this test process: {e}", stacklevel=3)
    return _server


#: What :func:`popen` returns: a forked child, or a plain subprocess.
Process = Forked | subprocess.Popen[Any]


def popen(argv: Sequence[str], **kwargs: Any) -> Process:
    """Start ``[sys.executable, "-m", MODULE, *ARGS]`` as subprocess.Popen would, forked from
    the shared server when a fork gives the same process; as a plain subprocess otherwise."""
    _module(argv)
    server = shared()
    env = kwargs.get("env")
    if server is None or not server.takes(os.environ if env is None else env):
        return subprocess.Popen(list(argv), **kwargs)
    return server.popen(argv, **kwargs)


def run(argv: Sequence[str], *, timeout: float | None = None, capture_output: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """subprocess.run for a module, through :func:`popen`."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p = popen(argv, **kwargs)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(list(argv), p.wait(), out, err)


def shutdown() -> None:
    """Stop this process's server, if one started (the test session's end)."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None

