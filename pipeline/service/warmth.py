"""The planes codec loaded at a process's start where frames are coming (docs/design.md,
"Compression on the wire").

Splitting and merging planes needs numpy, about 0.2 CPU-seconds to load here. Loaded on first
use, it was paid inside the first checkpoint's store by every process that sent or received a
frame (the trainer host's Dramatiq processes, each storage worker): 1.1 CPU-seconds more than
a store in zstd frames, on two cores that a 1 Gbit store keeps busy. A process that will see
frames loads it before it says it is ready (a Dramatiq process, the watcher, whose early sends
upload while a checkpoint is hashed, the command server that runs restores); a storage worker
once an authenticated request came from another host (workers/app.py). A cluster on one host
sends over loopback as it is, and never loads it.
"""
from __future__ import annotations

import logging
from urllib.parse import urlsplit

from pipeline import codec
from pipeline.cluster.decoding import PLANES
from pipeline.cluster.wire import is_loopback
from pipeline.settings import Settings

log = logging.getLogger("ckpt.service")


def worker_urls(settings: Settings) -> list[str]:
    """The storage workers this host knows: its static list and those the control plane recorded
    (found over mDNS on an earlier start). Only the static list when the control plane cannot be read."""
    urls = list(settings.workers)
    try:
        from sqlalchemy import select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import StorageWorker
        from pipeline.states import Tier

        with session_scope(settings.db_url, readonly=True) as s:
            urls += s.scalars(select(StorageWorker.url).where(StorageWorker.tier == Tier.WORKERS))
    except Exception as exc:  # no schema yet, or the control plane is away: the static list decides
        log.debug("could not read the known storage workers: %s", exc)
    return urls


def frames_coming(settings: Settings, urls: list[str]) -> bool:
    """Whether this host may send or receive planes frames: it compresses on the wire, in planes
    frames, and one of ``urls`` (storage workers) is on another host."""
    if settings.wire_compression == "off" or PLANES not in settings.wire_codecs:
        return False
    return any(not is_loopback(urlsplit(u).hostname) for u in urls)


def warm_codec(settings: Settings) -> bool:
    """Load the codec now if frames are coming; whether it did."""
    if not frames_coming(settings, worker_urls(settings)):
        return False
    codec.warm()
    return True
