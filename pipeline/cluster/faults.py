"""What a peer's wrong answer or a stalled link raises, turned into that peer's error.

Every exchange with a storage worker or a candidate can fail below the client in ways that
are the peer's doing, not ours: the socket's errors (a refused or reset connection, a
timeout, TLS errors: all ``OSError``), and http.client's for an answer that is not HTTP
(``BadStatusLine``: an SSH server on the port answers ``SSH-2.0-...``), a body cut short
(``IncompleteRead``) or a line too long. :data:`PEER_FAULTS` names them; the client catches
them where it talks to a peer and raises :class:`~pipeline.errors.WorkerError` for that peer,
so a probe records it against that peer and a transfer moves to another worker
(docs/design.md, "Every answer is the peer's error").

Deadlines are by progress (docs/design.md, "Deadlines by progress"): a transfer fails when
no byte moved for a while, never after a fixed total. A socket's timeout already bounds each
receive and each wait of ``sendfile``; ``socket.sendall`` is the exception (its timeout bounds
the whole call since Python 3.5), so :func:`send_all` sends piece by piece.
"""
from __future__ import annotations

import http.client
import socket

#: What a bad peer or a broken link raises below the client.
PEER_FAULTS: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


class Stalled(TimeoutError):
    """Raised when no byte moved on a connection for its stall timeout."""


def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Send all of ``data``; each wait for the peer to take more is bounded by the socket's
    timeout, so a slow link that keeps moving is never cut, a stalled one fails (:class:`Stalled`)."""
    view = memoryview(data).cast("B")
    while view:
        try:
            n = sock.send(view)
        except TimeoutError:
            raise Stalled(f"no byte moved for {sock.gettimeout():g} s") from None
        view = view[n:]


def describe(exc: BaseException, timeout: float | None = None) -> str:
    """What went wrong with a peer, in words an operator can act on (``timeout``: the
    connection's, for a receive that timed out)."""
    if isinstance(exc, http.client.RemoteDisconnected):
        return "closed the connection without answering"
    if isinstance(exc, http.client.BadStatusLine):
        line = str(exc.args[0] if exc.args else "")[:80]
        return f"answered something that is not HTTP ({line.strip()!r}): another service on this port?"
    if isinstance(exc, http.client.IncompleteRead):
        due = f": {exc.expected:,} more bytes were due" if exc.expected else ""
        return f"its answer was cut short{due}"
    if isinstance(exc, Stalled):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return f"no byte moved for {timeout:g} s" if timeout else "timed out"
    return str(exc) or type(exc).__name__
