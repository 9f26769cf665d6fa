"""The object store's front in the chaos soak: ``python -m bench.chaos.front ADDR PORT SOCKET MODE``.

It runs on the box's ``objstore`` host, serves S3 on ``ADDR:PORT`` (the bridge: every host
reaches the store across its own link) and relays to SeaweedFS's unix socket ``SOCKET`` (the
server itself runs outside the box). While the file ``MODE`` says ``throttle`` it answers every
request 503 SlowDown, as S3 does to a client over its request rate. The soak's other store fault,
the partition, is made around it: its host's link down (a blackhole: connections time out) or the
front stopped (its port closed: connections refused).
"""
from __future__ import annotations

import sys
from pathlib import Path

from bench.s3front import Front, UnixConnection


class ChaosFront(Front):
    def __init__(self, address: tuple[str, int], socket_path: str, mode: Path) -> None:
        super().__init__(lambda: UnixConnection(socket_path), address)
        self.mode = mode

    def fault(self, method: str) -> tuple[int, str] | None:
        try:
            throttled = self.mode.read_text().strip() == "throttle"
        except OSError:
            throttled = False
        return (503, "SlowDown") if throttled else None


def main() -> int:
    addr, port, socket_path, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    front = ChaosFront((addr, port), socket_path, mode)
    print(f"object store front on {front.endpoint} for {socket_path}", flush=True)
    front.httpd.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
