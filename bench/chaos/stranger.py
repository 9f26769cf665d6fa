"""A stranger on a storage worker's port: ``python -m bench.chaos.stranger ADDR PORT``.

It answers every connection the way another service would (an SSH banner, then whatever it
reads echoed back as noise) and never speaks HTTP: the peer a probe or a copy meets when a
worker's port was taken over (issue 28, "one non-HTTP answer").
"""
from __future__ import annotations

import socket
import sys
import threading

BANNER = b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n"


def answer(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(30)
        try:
            conn.sendall(BANNER)
            while data := conn.recv(65536):
                conn.sendall(b"\x00\xffProtocol mismatch.\r\n" + data[:64][::-1])
        except OSError:
            pass


def main() -> int:
    addr, port = sys.argv[1], int(sys.argv[2])
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(64)
    print(f"stranger answering garbage on {addr}:{port}", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    raise SystemExit(main())
