"""A served command: the child ``ckpt up``'s command server forked for a caller.

It becomes what the caller would have been (its standard streams, directory, umask,
environment, arguments, ignored and blocked signals, ``sys.path``), waits for the caller's "go",
runs :func:`pipeline.cli.main.main`, ends as the interpreter would have ended (non-daemon
threads joined, ``atexit``, streams flushed: exit 120 if that fails; an uncaught exception
through ``sys.excepthook``, exit 1; Ctrl-C: killed by SIGINT), says its exit status on the
caller's connection and exits. It ends with its caller: a caller killed outright closes the
connection, and this process kills itself (the server, which is never stopped, does the same
from outside, for a child that is stopped).
"""
from __future__ import annotations

import atexit
import importlib
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from pipeline.service.caller import Caller

#: Set once the command ended (its caller may then go: its closing is no longer a kill).
_ending = False


def become(conn: socket.socket, request: dict[str, Any], caller: Caller, close: Callable[[], None]) -> None:
    """In the forked child: become the caller's command, run it, say how it ended, exit.
    ``close``: closes what of the server this child holds (listener, other connections)."""
    code = 1
    fds: list[int] = []
    try:
        os.setpgid(0, 0)  # out of the server's group: a `ckpt up` that kills it leaves the commands be
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        close()
        conn.settimeout(None)
        go, fds, _flags, _addr = socket.recv_fds(conn, 16, 4)  # its stdin, stdout, stderr and directory
        if go != b"go" or len(fds) != 4:  # the caller ran it itself, or is gone
            os._exit(0)
        _take(fds, request, caller)
        threading.Thread(target=_with_caller, args=(conn,), name="ckpt-caller", daemon=True).start()
        code = _run(request["argv"])
    except KeyboardInterrupt:
        _interrupted()
    except BaseException:  # the child ends here, whatever happened
        traceback.print_exc()
        _flush()
    global _ending
    _ending = True
    try:
        conn.send(json.dumps({"exit": code}).encode())
    except OSError:
        pass
    os._exit(code)


def _take(fds: list[int], request: dict[str, Any], caller: Caller) -> None:
    stdin, stdout, stderr, cwd = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    os.fchdir(cwd)
    for fd in fds:
        os.close(fd)
    os.umask(caller.umask)
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()  # the C library read TZ as the server started
    sys.argv = ["ckpt", *request["argv"]]
    sys.path[:] = request.get("path") or sys.path
    importlib.invalidate_caches()
    # Signals as the caller had them: ignored ones stay ignored (nohup, `ckpt restore &` in a
    # script), Ctrl-C is KeyboardInterrupt otherwise, as Python sets it up at its start.
    for sig in caller.ignored:
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    if signal.SIGINT not in caller.ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, caller.blocked)
    _streams()
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)


def _with_caller(conn: socket.socket) -> None:
    """End with the caller: killed outright (SIGKILL, a test's timeout), it cannot forward the
    signal, and the command it ran would otherwise go on without anyone waiting for it."""
    try:
        conn.recv(1)
    except OSError:
        pass
    if not _ending:
        os.kill(os.getpid(), signal.SIGKILL)


def _run(argv: list[str]) -> int:
    from pipeline.cli.main import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors, --help
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    return _exit_as_the_interpreter(code)


def _exit_as_the_interpreter(code: int) -> int:
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at interpreter exit
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        return 120  # what Python exits with when stdout cannot be flushed at exit
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return code


def _interrupted() -> None:
    """Ctrl-C: as Python ends on it, the traceback then killed by SIGINT."""
    traceback.print_exc()
    _flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)


def _streams() -> None:
    """Standard streams on the caller's descriptors, buffered as a process started there would be
    (stdout by lines on a terminal, else by blocks; stderr by lines; ``PYTHONUNBUFFERED``)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors,
                                  line_buffering=fd == 2 or (fd == 1 and raw.isatty()),
                                  write_through=fd != 0 and unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
