"""The command server ``ckpt up`` runs: ``ckpt restore`` and ``ckpt status`` without their start-up.

One process that imported what those commands import, listening on ``<home>/run/commands.sock``
(a ``SOCK_SEQPACKET`` unix socket, this user's only). For each request of
:mod:`pipeline.cli.warm` it checks that a process forked from it would run the command exactly
as the caller would (pipeline/service/caller.py), forks, and the child becomes the caller's
command (pipeline/service/served.py). The child starts only once the caller said "go" (a caller
that gave up waiting for the answer runs the command itself; it never runs twice), says its exit
status itself, and outlives this process (stopping ``ckpt up`` does not cut a restore short). This
process says how a child that was killed ended, and kills a child whose caller is gone (watched
through a pidfd: a child stopped by Ctrl-Z cannot see it itself).

It is single-threaded (a fork copies only the forking thread) and never opens the database
or the broker: a child starts with nothing open but what the caller gave it.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.cli.warm import MESSAGE, SOCKET, WARM, peer_credentials
from pipeline.service.caller import Caller, join_cgroup, refusal
from pipeline.service.served import become

log = logging.getLogger("ckpt.commands")
def preload() -> None:
    """Import what the warm commands import, so that their children start with it."""
    import sqlalchemy.dialects.postgresql
    import sqlalchemy.dialects.sqlite  # noqa: F401

    import pipeline.cli.main
    import pipeline.cli.status_view
    import pipeline.operations
    import pipeline.restoring.job
    import pipeline.restoring.rebuild
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


@dataclass
class Served:
    """A running child: its caller's connection, and the caller itself (a pidfd) to watch."""

    conn: socket.socket
    caller: int  # pidfd
    watched: bool = True  # the caller's pidfd is in the selector


class Server:
    #: How long a caller may take to send its request once connected (it sends at once).
    REQUEST_SECONDS = 0.5

    def __init__(self, home: Path) -> None:
        self.directory = home.joinpath(*SOCKET[:-1])
        self.code = Code()
        self.children: dict[int, Served] = {}
        self.stopping = False
        self.sel = selectors.DefaultSelector()

    def serve(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(self.directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.unlink(SOCKET[-1], dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)  # this user's only
        try:
            self.listener.bind(f"/proc/self/fd/{dir_fd}/{SOCKET[-1]}")
            # The file the bind made (a socket's own descriptor is another inode): removed at the
            # end only if it is still this one, not one a server started since made.
            self.socket_ino = os.stat(SOCKET[-1], dir_fd=dir_fd).st_ino
        finally:
            os.umask(old)
            os.close(dir_fd)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # wakes the loop through the pipe
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "signal")
        gc.freeze()  # children share these pages instead of copying them as their collector walks them
        log.info("serving %s at %s", ", ".join(sorted(WARM)), self.directory / SOCKET[-1])
        try:
            while not self.stopping:
                self._once()
        finally:
            self._stop_accepting()
        # The commands running go on; this process stays to say how a killed one ended (and to
        # kill one whose caller dies), then ends: ckpt up starts the next server meanwhile only
        # once this one exited, so commands run in their callers' processes until then.
        while self.children:
            self._once()

    def _once(self) -> None:
        for key, _ in self.sel.select():
            if key.data == "accept":
                self._accept()
            elif key.data == "signal":
                self._signalled()
            else:
                self._caller_gone(key.data)

    def _stop_accepting(self) -> None:
        if self.listener.fileno() < 0:
            return
        socket_path = self.directory / SOCKET[-1]
        try:
            if os.stat(socket_path).st_ino == self.socket_ino:
                socket_path.unlink()  # ours, not a server started since
        except OSError:
            pass
        self.sel.unregister(self.listener)
        self.listener.close()

    def _signalled(self) -> None:
        try:
            got = os.read(self.wake_r, 512)
        except BlockingIOError:
            got = b""
        if signal.SIGTERM in got or signal.SIGINT in got:
            self.stopping = True  # the running commands go on, and say how they ended themselves
        self._reap()

    def _reap(self) -> None:
        """Every child that ended (and any other: a child is never left a zombie)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            served = self.children.pop(pid, None)
            if served is None:
                continue
            if served.watched:
                self.sel.unregister(served.caller)
            os.close(served.caller)
            with served.conn:
                if os.WIFSIGNALED(status):
                    try:
                        served.conn.send(json.dumps({"signal": os.WTERMSIG(status)}).encode())
                    except OSError:
                        pass

    def _caller_gone(self, child: int) -> None:
        """A caller exited while its command runs: killed outright, or stopped with it (Ctrl-Z)."""
        if child in self.children:
            try:
                os.kill(child, signal.SIGKILL)  # reaped at its SIGCHLD
            except ProcessLookupError:
                pass
            served = self.children[child]
            self.sel.unregister(served.caller)  # its pidfd stays readable; closed at the reap
            served.watched = False

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        caller = None
        try:
            conn.settimeout(self.REQUEST_SECONDS)
            data = conn.recv(MESSAGE)
            pid, uid, _gid = peer_credentials(conn)
            caller = os.pidfd_open(pid)
            request = json.loads(data)
            checked = refusal(request, pid, uid, self.code.changed())
            answer = self._fork(conn, request, checked, caller) if isinstance(checked, Caller) else checked
            if answer is not None:
                log.info("pid %d runs its command itself: %s", pid, answer)
                conn.send(json.dumps({"refused": answer}).encode())
                conn.close()
                os.close(caller)
                if answer.startswith("the code changed"):
                    self.stopping = True  # ckpt up starts this again, with the new code
        except Exception as exc:  # a bad request never ends the server
            log.warning("a command request failed: %s: %s", type(exc).__name__, exc)
            conn.close()
            if caller is not None and all(s.caller != caller for s in self.children.values()):
                os.close(caller)
        self._reap()

    def _fork(self, conn: socket.socket, request: dict, caller: Caller, pidfd: int) -> str | None:
        """Fork the caller's command; why not (None: it runs)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing of this process's buffers is written again by the child
        # Every signal blocked across the fork: one sent to the child before it reset this process's
        # handlers (a Ctrl-C forwarded at once) would reach this process's wakeup pipe instead.
        # Not range(1, NSIG): Python warns of the C library's own two (32, 33) on stderr, which
        # is the caller's in a child once a command reset the warning filters (boto3 does).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        child = os.fork()
        if child == 0:
            become(conn, request, caller, lambda: self._close_in_child(pidfd))  # never returns
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if (reason := join_cgroup(child, caller.cgroup)) is not None:
            os.kill(child, signal.SIGKILL)  # it waits for "go": it ran nothing
            os.waitpid(child, 0)
            return reason
        child_fd = os.pidfd_open(child)
        try:
            socket.send_fds(conn, [json.dumps({"pid": child}).encode()], [child_fd])
        except OSError:  # the caller gave up waiting (it runs the command itself): this one never starts
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            raise
        finally:
            os.close(child_fd)
        self.children[child] = Served(conn, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ, child)
        log.info("pid %d: ckpt %s runs as pid %d", caller.pid, " ".join(request["argv"]), child)
        return None

    def _close_in_child(self, pidfd: int) -> None:
        """In a child: close what of this process it holds (it keeps only its own connection)."""
        self.sel.close()
        self.listener.close()
        for fd in (self.wake_r, self.wake_w, pidfd):
            os.close(fd)
        for served in self.children.values():
            served.conn.close()
            os.close(served.caller)
        self.children.clear()


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.service.commands HOME``: what ``ckpt up`` starts."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Not the directory ckpt up started in (``-m`` put it first): a module there would shadow a
    # library for this process and every child (a child takes its caller's sys.path).
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
        del sys.path[0]
    preload()
    Server(Path(args[0])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
