"""The planes codec loaded at a process's start where frames are coming (docs/design.md,
"Compression on the wire").

Splitting and merging planes needs numpy, about 0.2 CPU-seconds to load here. Loaded on first
use, it was paid inside the first checkpoint's store by every process that sent or received a
frame (the trainer host's Dramatiq processes and watcher, each storage worker), on two cores
that a 1 Gbit store keeps busy. A process that will send frames loads it as it starts: a Dramatiq
process once it has said which queues it consumes, the watcher (its early sends upload while a
checkpoint is hashed); a storage worker bound to an address other hosts reach, as it starts
serving (workers/server.py). A cluster on one host sends as it is and never loads it. The
command server (pipeline/service/commands.py) does not: it never opens the control plane, and
forks its commands from one thread (numpy starts a thread pool); a restore loads it when a
frame comes.
"""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from pipeline import codec
from pipeline.cluster.decoding import PLANES
from pipeline.cluster.wire import is_loopback, own_address
from pipeline.settings import Settings

log = logging.getLogger("ckpt.service")


def elsewhere(url: str) -> bool:
    """Whether the storage worker at ``url`` is on another host: not loopback and not one of
    this host's own addresses (a one-host cluster addressed by its LAN address sends as it is,
    pipeline/cluster/wire.py ``same_host``). A name counts as another host: it is not looked up
    here (a name the resolver does not know would hold up the process's start)."""
    host = urlsplit(url).hostname
    if host is None or is_loopback(host):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return not own_address(host)


def recorded_urls(settings: Settings) -> list[str]:
    """The storage workers the control plane records as up or full (found over mDNS on an
    earlier start); none when it cannot be read (no schema yet, or it is away)."""
    try:
        from sqlalchemy import select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import StorageWorker
        from pipeline.states import COUNTING_WORKERS, Tier

        with session_scope(settings.db_url, readonly=True) as s:
            return list(s.scalars(select(StorageWorker.url).where(
                StorageWorker.tier == Tier.WORKERS, StorageWorker.state.in_(sorted(COUNTING_WORKERS)))))
    except Exception as exc:
        log.debug("could not read the known storage workers: %s", exc)
        return []


def frames_coming(settings: Settings, recorded: Iterable[str] | None = None) -> bool:
    """Whether this host may send planes frames: it compresses on the wire, in planes frames, and
    a storage worker it knows (its static list, else those the control plane records; or
    ``recorded``) is on another host."""
    if settings.wire_compression == "off" or PLANES not in settings.wire_codecs:
        return False
    if any(elsewhere(u) for u in settings.workers):
        return True
    return any(elsewhere(u) for u in (recorded_urls(settings) if recorded is None else recorded))


def warm_codec(settings: Settings) -> bool:
    """Load the codec now if frames are coming; whether it did. Never raises: where it cannot,
    the codec loads on first use, as before."""
    try:
        if not frames_coming(settings):
            return False
        codec.warm()
        return True
    except Exception:
        log.exception("could not load the planes codec ahead; it loads on first use")
        return False
