"""A TCP proxy on loopback that breaks what goes through it, once per arming.

Faults, each applied to the first connection whose request starts with the armed prefix
(by default a shard's transfer: ``PUT /v1/shards/`` up, ``GET /v1/shards/`` down) and that
carries more than ``after`` bytes in the given direction (``up``: client to server,
``down``: server to client). Other traffic (probes, re-hashes, inventories) passes:

    flip      flip one bit of the byte at ``after``
    reset     abort both connections there (RST)
    truncate  close both connections there, cleanly (FIN): the body ends early
"""
from __future__ import annotations

import socket
import struct
import threading


class Proxy:
    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.fault: tuple[str, str, int, bytes] | None = None
        self.applied = 0
        self.closed = False
        self.open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, kind: str, direction: str, after: int, request: bytes | None = None) -> None:
        """Break the next matching connection; ``request`` is the prefix of the request it
        must carry (default: a shard upload for ``up``, a shard download for ``down``)."""
        prefix = request if request is not None else (b"PUT /v1/shards/" if direction == "up" else b"GET /v1/shards/")
        with self.lock:
            self.fault = (kind, direction, after, prefix)

    def _take(self, direction: str, seen: int, n: int, request: bytes) -> tuple[str, int] | None:
        """The fault to apply to this chunk (kind, offset in chunk), consuming the arming."""
        with self.lock:
            if (self.fault and self.fault[1] == direction and seen + n > self.fault[2]
                    and request.startswith(self.fault[3])):
                kind, _d, after, _prefix = self.fault
                self.fault = None
                self.applied += 1
                return kind, max(0, after - seen)
        return None

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self.lock:
                self.open.update((client, server))
            request = bytearray()  # the first bytes the client sent: which request this is
            for a, b, d in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(a, b, d, request, client, server), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, request: bytearray,
              *both: socket.socket) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if direction == "up" and len(request) < 64:
                    request += data[:64 - len(request)]
                fault = self._take(direction, seen, len(data), bytes(request))
                if fault:
                    kind, at = fault
                    if kind == "flip":
                        data = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]
                    elif kind == "reset":
                        dst.sendall(data[:at])
                        for s in both:
                            # Linger 0: close sends RST. SHUT_RD first wakes the other pump,
                            # whose recv would otherwise keep the socket open (and silent).
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            s.shutdown(socket.SHUT_RD)
                            s.close()
                        return
                    elif kind == "truncate":
                        dst.sendall(data[:at])
                        for s in both:
                            s.shutdown(socket.SHUT_RDWR)
                            s.close()
                        return
                dst.sendall(data)
                seen += len(data)
        except OSError:
            for s in both:
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Stop accepting and cut every connection still open."""
        self.closed = True
        self.listener.close()
        with self.lock:
            for s in self.open:
                try:
                    s.close()
                except OSError:
                    pass
            self.open.clear()
