"""A TCP listener that forwards each connection to a Unix socket (run inside a namespace).

``python -m tests.multihost.forward HOST PORT UNIX_PATH``: the multi-host test reaches the
machine's PostgreSQL (whose Unix socket every network namespace shares, being a file) over
a namespace's own TCP address.
"""
from __future__ import annotations

import socket
import sys
import threading


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(host: str, port: int, path: str) -> None:
    listener = socket.create_server((host, port))
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(path)
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
