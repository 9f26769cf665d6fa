"""A command run by ``ckpt up``'s command server, its imports already done.

``ckpt restore`` and ``ckpt status`` spend a third of a second importing SQLAlchemy and the
pipeline before they do anything: a quarter of a 1 GB restore on loopback, most of a status.
Where ``ckpt up`` runs (its home has ``run/commands.sock``), this module, which imports nothing
but the standard library and :mod:`pipeline.home`, hands the command to the command server
(pipeline/service/commands.py): it forks a process that already imported everything, which
runs the command with this process's arguments, environment, current directory and standard
streams (passed as descriptors), and says how it ended. This process forwards the signals it
gets (Ctrl-C) to that one and ends as it ended.

The server refuses whatever it could not run exactly as this process would (another user,
interpreter, code, namespace, cgroup, limits or priority: docs/design.md, "Warm commands"),
and then, or when there is no server, nothing answers, or ``CKPT_WARM=0``, the command runs
in this process as before. Once the server has forked the command, it is never run twice: a
command that ends without saying how says so and fails.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from types import FrameType

#: The commands the server runs: they neither prompt nor run a service.
WARM = frozenset({"restore", "status"})
#: The socket, under the home.
SOCKET = ("run", "commands.sock")
#: How long the server may take to answer before the command runs here instead.
ANSWER_SECONDS = 5.0
#: Largest message either side sends (the request carries the environment).
MESSAGE = 256 * 1024
#: Signals forwarded to the command as they are (Ctrl-Z stops and continues it with this process).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def command_of(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """``(subcommand, --home value)`` as the parser would find them, (None, _) when unsure."""
    home, i = None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--home":
            if i + 1 >= len(argv):
                return None, None
            home, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--home="):
            home = arg.partition("=")[2]
        elif arg in ("-v", "--verbose"):
            pass
        elif arg.startswith("-"):
            return None, None
        else:
            rest = argv[i + 1:]
            for j, later in enumerate(rest):  # ``ckpt status --home DIR``
                if later == "--home" and j + 1 < len(rest):
                    home = rest[j + 1]
                elif later.startswith("--home="):
                    home = later.partition("=")[2]
            return arg, home
        i += 1
    return None, None


def main() -> int:
    """The ``ckpt`` script (and ``python -m pipeline.cli``): this process's command, served or run here."""
    argv = sys.argv[1:]
    served = run(argv)
    if served is not None:
        return served
    from pipeline.cli.main import main as here

    return here(argv)


def run(argv: Sequence[str]) -> int | None:
    """Run ``ckpt argv`` through the command server: its exit status, or None when it is to
    run in this process (no server, refused, or not a warm command)."""
    if sys.platform != "linux" or os.environ.get("CKPT_WARM", "1") == "0":
        return None
    command, flag = command_of(argv)
    if command not in WARM:
        return None
    for fd in (0, 1, 2):  # a closed one is passed as closed only by running here
        try:
            os.fstat(fd)
        except OSError:
            return None
    from pipeline import home

    try:
        directory = home.find(flag, os.environ).path.joinpath(*SOCKET[:-1])
        dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(ANSWER_SECONDS)  # a server that does not accept (stopped, its queue full)
            # Through the directory's descriptor: a home's path may be longer than a socket's 107 bytes.
            sock.connect(f"/proc/self/fd/{dir_fd}/{SOCKET[-1]}")
            # Only this user's own server gets this process's environment, terminal and directory.
            if peer_credentials(sock)[1] != os.geteuid():
                sock.close()
                return None
        except OSError:
            sock.close()
            return None
    finally:
        os.close(dir_fd)
    with sock:
        return _served(sock, list(argv))


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket (``SO_PEERCRED``)."""
    import struct

    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def request_of(argv: list[str]) -> bytes:
    """What the server is asked: the command, and what of this process it must run it with."""
    return json.dumps({"argv": argv, "env": dict(os.environ), "python": sys.executable, "version": sys.version,
                       "flags": list(sys.flags), "package": package_dir(), "path": sys.path,
                       "warnoptions": sys.warnoptions,
                       # -u (sys.flags does not say): the interpreter's stdout writes through.
                       "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
                       "xoptions": {k: str(v) for k, v in sys._xoptions.items()}}).encode()


def _served(sock: socket.socket, argv: list[str]) -> int | None:
    request = request_of(argv)
    if len(request) > MESSAGE:
        return None
    try:
        # The descriptors go with "go", to the forked child, never to a server that has not answered:
        # one stopped would hold them (this process's pipes open after it ended) until it runs again.
        sock.settimeout(ANSWER_SECONDS)
        sock.send(request)
        data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE, 1)
    except (OSError, ValueError):
        return None  # nothing forked yet (or nothing that will start: it waits for "go")
    answer = json.loads(data or b"{}")
    if "pid" not in answer:
        for fd in fds:
            os.close(fd)
        return None  # refused: answer["refused"] says why (CKPT_WARM=0 shows the same command run here)
    pidfd = fds[0] if fds else None
    # A signal this process ignores (nohup's SIGHUP) the command ignores too: it is not forwarded.
    handlers = {sig: _forward(answer["pid"], pidfd) for sig in FORWARDED}
    handlers[signal.SIGTSTP] = _suspend(answer["pid"], pidfd)
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()
                if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        try:  # O_PATH: a directory this process may enter but not list is still its directory
            cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None  # the child, told nothing, exits having done nothing
        try:
            socket.send_fds(sock, [b"go"], [0, 1, 2, cwd])
        except OSError:
            return None
        finally:
            os.close(cwd)
        sock.settimeout(None)
        while True:
            try:
                data = sock.recv(MESSAGE)
                break
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pidfd is not None:
            os.close(pidfd)
    end = json.loads(data or b"{}")
    if "signal" in end:  # end as the command ended: a shell sees 128 + N
        signum = int(end["signal"])
        sys.stdout.flush()
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be handled, nor need resetting
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        return 128 + signum
    if "exit" in end:
        return int(end["exit"])
    print(f"ckpt: error: the command's process (pid {answer['pid']}) ended without saying how; run it again with "
          "CKPT_WARM=0 to run it in this process", file=sys.stderr)
    return 1


def _forward(pid: int, pidfd: int | None) -> Callable[[int, FrameType | None], None]:
    def handler(sig: int, _frame: FrameType | None) -> None:
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, OSError):
            pass
    return handler


def _suspend(pid: int, pidfd: int | None) -> Callable[[int, FrameType | None], None]:
    """Ctrl-Z: stop the command with this process, and continue it when this one is."""
    send = _forward(pid, pidfd)

    def handler(_sig: int, _frame: FrameType | None) -> None:
        send(signal.SIGSTOP, None)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stops here until the shell's SIGCONT
        signal.signal(signal.SIGTSTP, handler)
        send(signal.SIGCONT, None)
    return handler


def package_dir() -> str:
    """Where this process's ``pipeline`` package is: the server must run the same code."""
    import pipeline

    return os.path.dirname(os.path.abspath(pipeline.__file__))
