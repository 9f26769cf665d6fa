"""Whether a TCP port is free, and which process listens on it (Linux's /proc).

``ckpt up`` refuses a busy web port before it starts anything, and counts its web UI as ready
only once the listening socket on the port is its own child's: another process answering on
that port (a second project's ``ckpt up``) is that other UI, never this one's.
"""
from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable

_LISTEN = "0A"


def in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because something listens there (bound the way
    gunicorn binds: with SO_REUSEADDR, so a port left in TIME_WAIT counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def listeners(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address, IPv4 or IPv6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        out.add(cols[9])
        except FileNotFoundError:
            continue
    return out


def _sockets(pid: int) -> set[str]:
    out: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def held_by(pids: Iterable[int], port: int) -> bool:
    """Whether one of ``pids`` holds a socket listening on ``port``."""
    inodes = listeners(port)
    return bool(inodes) and any(_sockets(pid) & inodes for pid in pids)


def owner(port: int) -> int | None:
    """The pid of a process listening on ``port``, when this user may see it."""
    inodes = listeners(port)
    if not inodes:
        return None
    # The lowest pid first: a server's master holds the socket its forked workers share.
    for pid in sorted(int(e) for e in os.listdir("/proc") if e.isdigit()):
        if _sockets(pid) & inodes:
            return pid
    return None


def busy_message(port: int) -> str:
    """What ``ckpt up`` says of a web port another process holds."""
    pid = owner(port)
    by = f" (by pid {pid})" if pid is not None else ""
    return f"port {port} is in use{by}: pass --web-port P (another free port, or 0 for no web UI)"
