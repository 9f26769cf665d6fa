"""A preloaded trainer process that forks each writer the tests start (the server side).

    python -m tests.writers.forkserver PARENT_PID CONTROL_FD MODULE[,MODULE...]

Every trainer or writer a test starts (``python -m tests.writers.write ...``, ``protected``,
``train``) first imports torch and transformers or Lightning: 4.4 s of CPU each, dozens of times
a run. This process imports those libraries once (never ``pipeline`` nor a ``tests.writers``
module: they read their settings at import, and each child must import them afresh under its own
environment), then forks one child per request. The child takes the request's argv, environment
(replaced wholesale, then given what the preloaded libraries wrote to it as they were
imported), working directory and stdin/stdout/stderr (the test's own descriptors,
passed over a Unix socket with SCM_RIGHTS), runs the module as ``__main__`` as ``python -m``
would, and exits with its exit status. The server reports the child's pid, signals it through a
pidfd (never a reused pid) and reaps it, reporting its wait status. The test side, a
``subprocess``-like handle and one server per test process, is tests/writers/forked.py.

What a forked child does not get afresh: the libraries' import-time reads of the environment
(forked.py sends a request whose environment differs there to a plain subprocess), their
import-time warnings on stderr, the hash seed, ``sys.orig_argv``.

The server forks with one thread: numpy's OpenBLAS starts a second at import (one per further
core) and stops it before every fork (its ``pthread_atfork`` handler; a child starts its own when
it first needs it); torch starts none at import and the server runs no tensor operation, so
torch's OpenMP pool does not exist in it. The server dies with the test process's thread that
started it (``PR_SET_PDEATHSIG``), and every child with the server.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

_MAX = 1 << 20  # the largest message (an environment is a few kB)
_PR_SET_PDEATHSIG = 1
_inherited: list[TextIO] = []
#: A variable a preloaded library wrote at import: its value before and after (None: unset).
Written = tuple[str | None, str | None]  # in a child: the server's sys.stdout and sys.stderr (on fds 1 and 2 too)


def send(sock: socket.socket, doc: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One message (a JSON document) on a SOCK_SEQPACKET socket, with descriptors."""
    socket.send_fds(sock, [json.dumps(doc).encode()], list(fds))


def receive(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; ``None`` once the peer is gone."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX, maxfds)
    return (json.loads(msg) if msg else None), fds


def _open_fds() -> set[int]:
    """This process's open descriptors (not the one the listing itself used)."""
    listed = [int(name) for name in os.listdir("/proc/self/fd")]
    out = set()
    for fd in listed:
        with contextlib.suppress(OSError):
            os.fstat(fd)
            out.add(fd)
    return out


def _die_with_parent() -> None:
    """SIGKILL when the thread that forked this process ends."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket | None  # the test's handle; None once it let go


class _Server:
    def __init__(self, control: socket.socket, imported: dict[str, Written]) -> None:
        # What the interpreter and the preloaded libraries opened: a child keeps those and closes
        # the server's own (the control socket, the selector, the test's handles, the pidfds).
        self.own_fds = _open_fds() - {control.fileno()}
        self.control = control
        self.imported = imported
        self.children: dict[int, _Child] = {}  # by pid
        self.sel = selectors.DefaultSelector()
        # What a fresh ``python -m`` has on sys.path after its own first entry and PYTHONPATH's.
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.base_path = sys.path[1 + len(pythonpath):]

    def serve(self) -> None:
        self.sel.register(self.control, selectors.EVENT_READ, None)
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    if not self.request():
                        return
                else:
                    kind, child = key.data
                    if kind == "exit":
                        self.exited(child)
                    else:
                        self.message(child)

    def request(self) -> bool:
        req, fds = receive(self.control, 4)
        if req is None:  # the test process let go: nothing it started may outlive it
            for child in list(self.children.values()):
                signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
                os.waitpid(child.pid, 0)
            return False
        conn, stdio = socket.socket(fileno=fds[0]), fds[1:]
        if not os.path.isdir(req["cwd"]):  # as Popen: the caller's error, not the child's
            send(conn, {"error": [errno.ENOENT, os.strerror(errno.ENOENT), req["cwd"]]})
            conn.close()
        else:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            pid = os.fork()
            if pid == 0:
                _child(req, stdio, keep=self.own_fds | set(stdio), base_path=self.base_path, imported=self.imported)
            child = _Child(pid, os.pidfd_open(pid), conn)
            self.children[pid] = child
            self.sel.register(child.pidfd, selectors.EVENT_READ, ("exit", child))
            self.sel.register(conn, selectors.EVENT_READ, ("message", child))
            send(conn, {"pid": pid})
        for fd in stdio:
            os.close(fd)
        return True

    def exited(self, child: _Child) -> None:
        _, status = os.waitpid(child.pid, 0)
        self.sel.unregister(child.pidfd)
        os.close(child.pidfd)
        del self.children[child.pid]
        if child.conn is not None:
            with contextlib.suppress(OSError):
                send(child.conn, {"status": status})
            self.let_go(child)

    def message(self, child: _Child) -> None:
        if child.conn is None:  # reaped in this same round
            return
        try:
            msg, _ = receive(child.conn)
        except OSError:
            msg = None
        if msg is None:  # the handle is gone; the child runs on and is reaped when it ends
            self.let_go(child)
            return
        try:
            signal.pidfd_send_signal(child.pidfd, msg["signal"])
        except ProcessLookupError:
            pass
        send(child.conn, {"signalled": msg["signal"]})

    def let_go(self, child: _Child) -> None:
        assert child.conn is not None
        self.sel.unregister(child.conn)
        child.conn.close()
        child.conn = None


def _child(req: dict[str, Any], stdio: list[int], *, keep: set[int], base_path: list[str],
           imported: dict[str, Written]) -> NoReturn:
    """Become ``python -m MODULE ARGS`` with the request's environment, directory and stdio."""
    code, interrupted = 1, False
    try:
        _die_with_parent()
        for fd in _open_fds() - keep:  # the server's own, as Popen's close_fds
            if fd > 2:
                os.close(fd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in set(stdio):
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(req["cwd"])
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        for name, (was, now) in imported.items():  # what the preloaded libraries wrote at import
            if env.get(name) != was:  # the request's own value (forked.py forks it only if it is ``now``)
                continue
            if now is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = now
        pythonpath = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *pythonpath, *base_path]
        sys.argv = ["-m", *req["args"]]
        _fresh_stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
            del sys.modules[name]  # found again through the child's own sys.path
        importlib.invalidate_caches()
        if "numpy.random" in sys.modules:  # its global generator is seeded at import: one seed per process
            sys.modules["numpy.random"].seed()
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt as e:
            _print_uncaught(e)
            interrupted = True
        except BaseException as e:
            _print_uncaught(e)
            code = 1
        code = _finalize(code)
    except BaseException:  # the fork itself went wrong: say so where the test reads
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
    if interrupted:  # as CPython: an uncaught KeyboardInterrupt ends the process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _print_uncaught(e: BaseException) -> None:
    """The traceback ``python -m`` prints, from runpy down (not the server's frames)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)


def _fresh_stdio(*, unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on fds 0-2 as the interpreter builds them at start-up."""
    def stream(fd: int, like: Any) -> TextIO:
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffered: Any = raw
        if fd == 0:
            buffered = io.BufferedReader(raw)
        elif not unbuffered:
            buffered = io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding=like.encoding, errors=like.errors,
                                line_buffering=fd == 2 or (fd == 1 and raw.isatty()),
                                write_through=unbuffered and fd > 0)

    _inherited.extend([sys.stdout, sys.stderr])
    sys.stdin = sys.__stdin__ = stream(0, sys.__stdin__ or sys.stdin)  # type: ignore[misc,assignment]
    sys.stdout = sys.__stdout__ = stream(1, sys.__stdout__ or sys.stdout)  # type: ignore[misc,assignment]
    sys.stderr = sys.__stderr__ = stream(2, sys.__stderr__ or sys.stderr)  # type: ignore[misc,assignment]


def _exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as CPython computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _finalize(code: int) -> int:
    """What the interpreter does at exit (Py_FinalizeEx): threading's shutdown (its exit hooks,
    such as the wait for ThreadPoolExecutor's work, then the join of non-daemon threads), the
    atexit functions, stdout flushed (120 if that fails) and stderr. The child then leaves by
    ``os._exit``: nothing of the server's runs in it."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except Exception:
        code = 120
    for stream in (sys.stderr, *_inherited):  # the server's, which loggers made at import still hold
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def main(argv: list[str]) -> None:
    parent, control_fd, preload = int(argv[0]), int(argv[1]), [m for m in argv[2].split(",") if m]
    _die_with_parent()
    if os.getppid() != parent:  # the test process ended before the line above
        raise SystemExit("the test process is gone")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the test's to handle; it ends the server
    control = socket.socket(fileno=control_fd)
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    # What the libraries wrote to the environment as they were imported (Lightning's
    # PYTORCH_NVML_BASED_CUDA_CHECK=1): each child has it too, as a fresh process importing them
    # would (and the processes it starts). The request's environment matches the server's in
    # every variable they read at import (forked.py), so they would write the same there.
    imported: dict[str, Written] = {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}
    imported.update({k: (v, None) for k, v in before.items() if k not in os.environ})
    settings_readers = sorted(m for m in sys.modules if m.split(".")[0] == "pipeline"
                              or (m.startswith("tests.") and m not in ("tests.writers", "tests.writers.forkserver")))
    if settings_readers:
        raise SystemExit(f"preloading {preload} imported {settings_readers}: each child must import them"
                         " afresh under its own environment")
    gc.collect()
    gc.freeze()  # the children never traverse what was preloaded (less CPU, fewer pages copied)
    server = _Server(control, imported)
    send(control, {"ready": os.getpid(), "threads": len(os.listdir("/proc/self/task")), "imported": imported})
    server.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
