"""How many event streams may be open at once: in all, and per client.

An event stream holds one of the web server's threads for as long as it is open; with no
limit, a few open job pages take every thread and the UI stops answering.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

_lock = threading.Lock()
_open: dict[str, int] = {}


@dataclass
class Slot:
    client: str
    released: bool = False

    def release(self) -> None:
        with _lock:
            if self.released:
                return
            self.released = True
            left = _open.get(self.client, 0) - 1
            if left > 0:
                _open[self.client] = left
            else:
                _open.pop(self.client, None)


def take(client: str, total: int, per_client: int) -> Slot | None:
    """A slot for one more stream of ``client``, or None when a limit is reached."""
    with _lock:
        if sum(_open.values()) >= total or _open.get(client, 0) >= per_client:
            return None
        _open[client] = _open.get(client, 0) + 1
        return Slot(client)


def open_count() -> int:
    with _lock:
        return sum(_open.values())
