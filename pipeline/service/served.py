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
    """In the forked child (every signal blocked, as the server forked it): become the caller's
    command, run it, say how it ended, exit; it never returns into the server's code.
    ``close``: closes what of the server this child holds (listener, other connections)."""
    code = 1
    try:
        try:
            signal.set_wakeup_fd(-1)  # before any signal is let in: the server's pipe is not this one's
            _signals_of(caller)
            os.setsid()  # a session of its own: the server's exit neither orphans its group nor hangs it up
            close()
            conn.settimeout(None)
            go, fds, _flags, _addr = socket.recv_fds(conn, 16, 4)  # its stdin, stdout, stderr and directory
            if go != b"go" or len(fds) != 4:  # the caller ran it itself, or is gone
                os._exit(0)
            _take(fds, request, caller)
            threading.Thread(target=_with_caller, args=(conn,), name="ckpt-caller", daemon=True).start()
            signal.pthread_sigmask(signal.SIG_SETMASK, caller.blocked)  # a Ctrl-C already sent arrives here
            code = _run(request["argv"])
        except KeyboardInterrupt:
            _interrupted(conn)
        except BaseException:  # the child ends here, whatever happened
            _said(traceback.print_exc)
            _flush()
        _say(conn, {"exit": code})
    finally:
        os._exit(code)


def _signals_of(caller: Caller) -> None:
    """Every signal as a process the caller started would have it (an exec resets handlers, not
    ignored signals): ignored where the caller ignores it, else the default; Ctrl-C is
    KeyboardInterrupt unless ignored, as Python sets it up at its start."""
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if sig in caller.ignored else signal.SIG_DFL)
        except (OSError, ValueError):  # the C library's own (32, 33)
            pass
    if signal.SIGINT not in caller.ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
    _streams(bool(request.get("unbuffered")))
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)


def _say(conn: socket.socket, end: dict[str, int]) -> None:
    """Tell the caller how the command ended (every signal blocked from here: nothing interrupts it)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    global _ending
    _ending = True
    try:
        conn.send(json.dumps(end).encode())
    except OSError:
        pass


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
    except BaseException:  # uncaught: as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    return _exit_as_the_interpreter(code)


def _exit_as_the_interpreter(code: int) -> int:
    """What the interpreter does at exit after the command returned, and its exit status: a
    stream the command closed is left alone; stdout that cannot be flushed is said on stderr as
    an unraisable exception, exit 120; stderr that cannot be flushed, exit 120."""
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at interpreter exit
    atexit._run_exitfuncs()
    if not _closed(sys.stdout):
        try:
            sys.stdout.flush()
        except (OSError, ValueError) as exc:
            code = 120
            _said(_unraisable(sys.stdout, exc))
    if not _closed(sys.stderr):
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            code = 120
    return code


def _unraisable(obj: object, exc: BaseException) -> Callable[[], None]:
    """What Python prints of an exception it cannot raise (a flush at exit): no traceback."""
    def say() -> None:
        print(f"Exception ignored in: {obj!r}", file=sys.stderr)
        traceback.print_exception(type(exc), exc, None)
    return say


def _closed(stream: Any) -> bool:
    return stream is None or bool(getattr(stream, "closed", False))


def _said(say: Callable[[], object]) -> None:
    """Say something on stderr if it can be said: a command may have closed it (``ckpt``
    does on a broken pipe), and the child must still say how it ended."""
    try:
        say()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _interrupted(conn: socket.socket) -> None:
    """Ctrl-C: as Python ends on it, the traceback then killed by SIGINT, said on the connection
    too (a server that ended meanwhile cannot say it)."""
    _said(traceback.print_exc)
    _flush()
    _say(conn, {"signal": int(signal.SIGINT)})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)


def _streams(unbuffered: bool = False) -> None:
    """Standard streams on the caller's descriptors, buffered as a process started there would be
    (stdout by lines on a terminal, else by blocks; stderr by lines; ``PYTHONUNBUFFERED``, or
    ``unbuffered``: the caller's own were, ``python -u``)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED")) or unbuffered
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        raw.name = f"<{name}>"  # as the interpreter names its own (in messages)
        # Unbuffered (-u, PYTHONUNBUFFERED): the text layer writes straight to the descriptor.
        buffered: Any = io.BufferedReader(raw) if fd == 0 else raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors,
                                  line_buffering=fd == 2 or (fd == 1 and raw.isatty()),
                                  write_through=fd != 0 and unbuffered)
        stream.mode = "r" if fd == 0 else "w"  # type: ignore[misc]
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
