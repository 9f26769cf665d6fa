"""Finding storage workers with mDNS (zeroconf): advertising and browsing.

A worker advertises ``_ckpt-store._tcp.local.`` under its node id, with its node id, API
version and zone in TXT records. The scheduler browses and records what it finds as a
``candidate``; admission needs the cluster-key challenge (pipeline.cluster.membership).

zeroconf uses only the configured addresses (loopback by default, so that nothing ever
multicast on real interfaces by accident); "all" means every interface.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from sqlalchemy import select
from zeroconf import (
    InterfaceChoice,
    ServiceBrowser,
    ServiceInfo,
    ServiceListener,
    Zeroconf,
)

from pipeline.db.engine import session_scope
from pipeline.db.models import StorageWorker
from pipeline.settings import Settings
from pipeline.states import WorkerState

log = logging.getLogger("ckpt.discovery")
SERVICE = "_ckpt-store._tcp.local."
API_VERSION = "1"


def interfaces(names: tuple[str, ...]) -> InterfaceChoice | list[str]:
    return InterfaceChoice.All if tuple(n.lower() for n in names) == ("all",) else list(names)


class Advertiser:
    """Registers one storage worker on mDNS until closed."""

    def __init__(self, node_id: str, host: str, port: int, zone: str, ifaces: tuple[str, ...]) -> None:
        addr = host if host not in ("0.0.0.0", "") else (ifaces[0] if ifaces and ifaces[0] != "all" else "127.0.0.1")
        self.zc = Zeroconf(interfaces=interfaces(ifaces))
        self.info = ServiceInfo(
            SERVICE, f"{node_id}.{SERVICE}", addresses=[socket.inet_aton(addr)], port=port,
            properties={"node": node_id, "api": API_VERSION, "zone": zone}, server=f"{node_id}.local.",
        )
        self.zc.register_service(self.info)
        log.info("advertising %s on mDNS at %s:%d", node_id, addr, port)

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


class _Listener(ServiceListener):
    def __init__(self, found: Callable[[str, str, str], None]) -> None:
        self.found = found

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        info = zc.get_service_info(type_, name, timeout=3000)
        if info is None or not info.parsed_addresses():
            return
        props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
        node = props.get("node") or name.split(".")[0]
        self.found(node, f"http://{info.parsed_addresses()[0]}:{info.port}", props.get("zone", ""))

    update_service = add_service

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        pass  # absence is judged by probes, not by goodbye packets


def record_candidate(settings: Settings, node: str, url: str, zone: str) -> None:
    """Remember a discovered worker; it stays a candidate until it proves the cluster key."""
    with session_scope(settings.db_url) as s:
        w = s.get(StorageWorker, node)
        if w is None:
            same_url = s.scalar(select(StorageWorker).where(StorageWorker.url == url))
            if same_url is not None:
                return  # already known under its real node id
            s.add(StorageWorker(id=node, url=url, zone=zone, source="mdns", state=WorkerState.CANDIDATE))
            log.info("found storage worker %s at %s on mDNS (candidate)", node, url)
        elif w.url != url and w.state != WorkerState.UP:
            w.url = url


class Browser:
    """Browses mDNS for storage workers and records them in the database."""

    def __init__(self, settings: Settings) -> None:
        self.zc = Zeroconf(interfaces=interfaces(settings.mdns_interfaces))
        self.browser = ServiceBrowser(self.zc, SERVICE, _Listener(
            lambda node, url, zone: record_candidate(settings, node, url, zone)))

    def close(self) -> None:
        self.browser.cancel()
        self.zc.close()
