"""The command server ``ckpt up`` runs: ``ckpt restore`` and ``ckpt status`` without their start-up.

One process that imported what those commands import, listening on ``<home>/run/commands.sock``
(a ``SOCK_SEQPACKET`` unix socket, this user's only). For each request of
:mod:`pipeline.cli.warm` it checks that a process forked from it would run the command exactly
as the caller would (:func:`refusal`), forks, and the child takes the caller's standard streams,
current directory (passed as descriptors), umask, environment and arguments, then runs
:func:`pipeline.cli.main.main`. The child starts only once the caller said "go" (a caller that
gave up waiting for the answer runs the command itself; it never runs twice), says its exit
status itself, and outlives this process (stopping ``ckpt up`` does not cut a restore short).
This process says only how a child that was killed ended.

It is single-threaded (a fork copies only the forking thread) and never opens the database
or the broker: a child starts with nothing open but what the caller gave it.
"""
from __future__ import annotations

import gc
import io
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from pipeline.cli.warm import MESSAGE, SOCKET, WARM, package_dir
from pipeline.priority import of_process

log = logging.getLogger("ckpt.commands")
#: Environment a process reads as it starts (the child never starts again): the caller's must
#: equal this process's, or the command would not run as it would there.
_AT_START = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONWARNINGS",
             "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONDEVMODE", "PYTHONMALLOC", "PYTHONFAULTHANDLER",
             "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME", "PYTHONNOUSERSITE", "PYTHONUSERBASE",
             "PYTHONPLATLIBDIR", "PYTHONINTMAXSTRDIGITS", "PYTHONSTARTUP", "LANG", "LC_ALL", "LC_CTYPE",
             "CKPT_FAILPOINTS")  # pipeline.failpoints reads it at import
#: What else of the caller a child must share, read from /proc (a container, a Slurm step's
#: cgroup and limits, another user's groups).
_NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts", "time")
#: Set in a child once its command ended (its caller may then go).
_ending = False
_STATUS = ("Uid:", "Gid:", "Groups:", "CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "NoNewPrivs:", "Seccomp:")


def preload() -> None:
    """Import what the warm commands import, so that their children start with it."""
    import sqlalchemy.dialects.postgresql
    import sqlalchemy.dialects.sqlite  # noqa: F401

    import pipeline.cli.main
    import pipeline.cli.status_view
    import pipeline.operations
    import pipeline.restore.job
    import pipeline.restore.rebuild
    import pipeline.status  # noqa: F401


class Code:
    """The files of every module this process imported (ours and the libraries': an upgrade of
    either under a running ``ckpt up``), to tell when one changed under it."""

    def __init__(self) -> None:
        self.files = {f: _mtime(f) for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}

    def changed(self) -> str | None:
        for f, mtime in self.files.items():
            if _mtime(f) != mtime:
                return f
        return None


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def refusal(request: dict[str, Any], pid: int, uid: int, code: Code) -> str | None:
    """Why a child of this process would not run ``request`` as its caller ``pid`` would; None: it would."""
    if uid != os.getuid():
        return "another user"
    if not request.get("argv") or not isinstance(request.get("env"), dict):
        return "not a request"
    for key, mine in (("python", sys.executable), ("version", sys.version), ("flags", list(sys.flags)),
                      ("package", package_dir())):
        if request.get(key) != mine:
            return f"another {key}: {request.get(key)!r}"
    env = request["env"]
    for name in _AT_START:
        if env.get(name) != os.environ.get(name):
            return f"another {name}"
    if (changed := code.changed()) is not None:
        return f"the code changed ({changed})"
    try:
        for ns in _NAMESPACES:
            try:
                mine_ns = os.readlink(f"/proc/self/ns/{ns}")
            except FileNotFoundError:  # a kernel without this kind of namespace
                continue
            if os.readlink(f"/proc/{pid}/ns/{ns}") != mine_ns:
                return f"another {ns} namespace"
        theirs, mine_root = os.stat(f"/proc/{pid}/root"), os.stat("/proc/self/root")
        if (theirs.st_dev, theirs.st_ino) != (mine_root.st_dev, mine_root.st_ino):
            return "another root directory"
        if Path(f"/proc/{pid}/limits").read_text() != Path("/proc/self/limits").read_text():
            return "other limits"
        status, mine_status = _status(pid), _status("self")
        for field in _STATUS:
            if status.get(field) != mine_status.get(field):
                return f"another {field.rstrip(':')}"
        if of_process(pid) != of_process(os.getpid()):
            return "another priority"
        request["umask"] = int(status.get("Umask:", "0022"), 8)
        request["cgroup"] = Path(f"/proc/{pid}/cgroup").read_text()
    except (OSError, ValueError) as exc:
        return f"cannot tell ({exc})"
    return None


def join_cgroup(pid: int, cgroup: str) -> str | None:
    """Move ``pid`` (a child) into the caller's ``cgroup`` (its /proc/PID/cgroup), so that it
    runs under the caller's limits and accounting; why it could not (None: it is there)."""
    if Path("/proc/self/cgroup").read_text() == cgroup:
        return None
    lines = cgroup.splitlines()
    if len(lines) != 1 or not lines[0].startswith("0::/"):
        return "another cgroup (not cgroup v2)"
    try:
        Path("/sys/fs/cgroup", lines[0][4:].lstrip("/"), "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        return f"another cgroup, which this process may not join ({exc.strerror})"
    return None


def _status(pid: int | str) -> dict[str, str]:
    """``/proc/PID/status`` as ``{"Uid:": "0 0 0 0", ...}``."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[f"{name}:"] = value.strip()
    return fields


class Server:
    def __init__(self, home: Path) -> None:
        self.directory = home.joinpath(*SOCKET[:-1])
        self.code = Code()
        self.children: dict[int, socket.socket] = {}
        self.stopping = False

    def serve(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(self.directory, os.O_PATH | os.O_DIRECTORY)
        path = f"/proc/self/fd/{dir_fd}/{SOCKET[-1]}"
        try:
            os.unlink(SOCKET[-1], dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # this user's only
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        listener.listen(64)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # wakes the loop through the pipe
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, "accept")
        sel.register(wake_r, selectors.EVENT_READ, "signal")
        gc.freeze()  # children share these pages instead of copying them as their collector walks them
        log.info("serving %s at %s", ", ".join(sorted(WARM)), self.directory / SOCKET[-1])
        try:
            while not self.stopping:
                for key, _ in sel.select():
                    if key.data == "accept":
                        self._accept(listener, (listener, sel, wake_r, wake_w, dir_fd))
                    else:
                        self._signalled(wake_r)
        finally:
            try:
                os.unlink(SOCKET[-1], dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            listener.close()

    def _signalled(self, wake_r: int) -> None:
        try:
            got = os.read(wake_r, 512)
        except BlockingIOError:
            got = b""
        if signal.SIGTERM in got or signal.SIGINT in got:
            self.stopping = True  # the running commands go on, and say how they ended themselves
        self._reap()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with conn:
                if os.WIFSIGNALED(status):
                    try:
                        conn.send(json.dumps({"signal": os.WTERMSIG(status)}).encode())
                    except OSError:
                        pass

    def _accept(self, listener: socket.socket, inherited: tuple) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(2.0)
            data, fds, _flags, _addr = socket.recv_fds(conn, MESSAGE, 4)
            pid, uid, _gid = socket_credentials(conn)
            request = json.loads(data)
            reason = refusal(request, pid, uid, self.code) if len(fds) == 4 else "no descriptors"
            if reason is not None:
                log.info("pid %d runs its command itself: %s", pid, reason)
                conn.send(json.dumps({"refused": reason}).encode())
                conn.close()
                if reason.startswith("the code changed"):
                    self.stopping = True  # ckpt up starts this again, with the new code
                return
            _flush()  # nothing of this process's buffers is written again by the child
            child = os.fork()
            if child == 0:
                _child(conn, fds, request, inherited)  # never returns
            if (reason := join_cgroup(child, request["cgroup"])) is not None:
                os.kill(child, signal.SIGKILL)  # it waits for "go": it ran nothing
                os.waitpid(child, 0)
                log.info("pid %d runs its command itself: %s", pid, reason)
                conn.send(json.dumps({"refused": reason}).encode())
                conn.close()
                return
            pidfd = os.pidfd_open(child)
            try:
                socket.send_fds(conn, [json.dumps({"pid": child}).encode()], [pidfd])
            finally:
                os.close(pidfd)
            self.children[child] = conn
            log.info("pid %d: ckpt %s runs as pid %d", pid, " ".join(request["argv"]), child)
        except Exception as exc:  # a bad request never ends the server
            log.warning("a command request failed: %s: %s", type(exc).__name__, exc)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)
        self._reap()


def socket_credentials(conn: socket.socket) -> tuple[int, int, int]:
    import struct

    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def _child(conn: socket.socket, fds: list[int], request: dict[str, Any], inherited: tuple) -> None:
    """In the forked child: become the caller's command, run it, say how it ended, exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        listener, sel, wake_r, wake_w, dir_fd = inherited
        sel.close()
        listener.close()
        for fd in (wake_r, wake_w, dir_fd):
            os.close(fd)
        conn.settimeout(None)
        if conn.recv(16) != b"go":  # the caller ran it itself, or is gone
            os._exit(0)
        threading.Thread(target=_with_caller, args=(conn,), name="ckpt-caller", daemon=True).start()
        stdin, stdout, stderr, cwd = fds
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        os.fchdir(cwd)
        for fd in fds:
            os.close(fd)
        fds.clear()
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["ckpt", *request["argv"]]
        _streams()
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
        code = _run(request["argv"])
    except BaseException:  # the child ends here, whatever happened
        traceback.print_exc()
    global _ending
    _ending = True
    try:
        conn.send(json.dumps({"exit": code}).encode())
    except OSError:
        pass
    os._exit(code)


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
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # ends as Python ends on Ctrl-C: killed by SIGINT
        raise
    import atexit

    atexit._run_exitfuncs()
    _flush()
    return code


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


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.service.commands HOME``: what ``ckpt up`` starts."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    preload()
    Server(Path(args[0])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
