"""Finding storage workers with mDNS (zeroconf): advertising and browsing.

A worker advertises ``_ckpt-store._tcp.local.`` under its node id, with its node id, API
version, zone and the cluster's fingerprint (an HMAC of a constant under the cluster key: it
tells nodes of one cluster apart and reveals nothing of the key) in TXT records. The scheduler
browses; an advert of another cluster (another fingerprint, or none) is ignored and counted,
never recorded, so strangers on a shared LAN neither show up nor slow anything down. An
advert of this cluster is recorded as a ``candidate``; admission needs the cluster-key
challenge (pipeline.cluster.membership). An advert never moves a known worker: a new address
is a candidate of its own until the worker proves itself there.

zeroconf uses only the configured addresses (loopback by default, so that nothing ever
multicast on real interfaces by accident); "all" means every interface.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
from collections.abc import Callable

from sqlalchemy import select
from zeroconf import (
    InterfaceChoice,
    ServiceBrowser,
    ServiceInfo,
    ServiceListener,
    Zeroconf,
)

from pipeline.db import workers
from pipeline.db.engine import session_scope
from pipeline.db.models import StorageWorker
from pipeline.settings import Settings

log = logging.getLogger("ckpt.discovery")
SERVICE = "_ckpt-store._tcp.local."
API_VERSION = "1"


def fingerprint(key: bytes) -> str:
    """The cluster's public fingerprint: the same for every node holding ``key``."""
    return hmac.new(key, b"ckpt-pipeline cluster fingerprint", hashlib.sha256).hexdigest()[:16]


def interfaces(names: tuple[str, ...]) -> InterfaceChoice | list[str]:
    return InterfaceChoice.All if tuple(n.lower() for n in names) == ("all",) else list(names)


class Advertiser:
    """Registers one storage worker on mDNS until closed."""

    def __init__(self, node_id: str, host: str, port: int, zone: str, ifaces: tuple[str, ...], key: bytes) -> None:
        addr = host if host not in ("0.0.0.0", "") else (ifaces[0] if ifaces and ifaces[0] != "all" else "127.0.0.1")
        self.zc = Zeroconf(interfaces=interfaces(ifaces))
        self.info = ServiceInfo(
            SERVICE, f"{node_id}.{SERVICE}", addresses=[socket.inet_aton(addr)], port=port,
            properties={"node": node_id, "api": API_VERSION, "zone": zone, "cluster": fingerprint(key)},
            server=f"{node_id}.local.",
        )
        self.zc.register_service(self.info)
        log.info("advertising %s on mDNS at %s:%d", node_id, addr, port)

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


class _Listener(ServiceListener):
    def __init__(self, cluster: str, found: Callable[[str, str, str], None]) -> None:
        self.cluster, self.found = cluster, found
        self.foreign: set[str] = set()  # names of adverts of other clusters seen
        self._lock = threading.Lock()

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        info = zc.get_service_info(type_, name, timeout=3000)
        if info is None or not info.parsed_addresses():
            return
        try:
            props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
        except UnicodeDecodeError:
            props = {}
        if props.get("cluster") != self.cluster:
            with self._lock:
                new = name not in self.foreign
                self.foreign.add(name)
            if new:
                log.info("ignoring %s on mDNS: a storage worker of another cluster (%d ignored so far)",
                         name, len(self.foreign))
            return
        node = props.get("node") or name.split(".")[0]
        self.found(node[:64], f"http://{info.parsed_addresses()[0]}:{info.port}", props.get("zone", "")[:64])

    update_service = add_service

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        pass  # absence is judged by probes, not by goodbye packets


def record_candidate(settings: Settings, node: str, url: str, zone: str) -> None:
    """Remember a discovered worker's address; it stays a candidate until it proves the
    cluster key there. A known worker's recorded URL is never changed by an advert."""
    with session_scope(settings.db_url) as s:
        if s.scalar(select(StorageWorker.id).where(StorageWorker.url == url)) is not None:
            return  # this address is probed already
        row_id = node
        if s.get(StorageWorker, node) is not None:  # known elsewhere: this address must prove itself
            row_id = f"{node}@{hashlib.sha256(url.encode()).hexdigest()[:8]}"
        if s.get(StorageWorker, row_id) is not None:
            return
        workers.add(s, row_id, url, source="mdns", zone=zone)
        log.info("found storage worker %s at %s on mDNS (candidate)", node, url)


class Browser:
    """Browses mDNS for storage workers and records them in the database."""

    def __init__(self, settings: Settings) -> None:
        self.zc = Zeroconf(interfaces=interfaces(settings.mdns_interfaces))
        self.listener = _Listener(fingerprint(settings.key()),
                                  lambda node, url, zone: record_candidate(settings, node, url, zone))
        self.browser = ServiceBrowser(self.zc, SERVICE, self.listener)

    def close(self) -> None:
        self.browser.cancel()
        self.zc.close()
