"""This machine's identity among the training hosts (docs/design.md, "Hosts").

A host is named by an id, not by its hostname: ``CKPT_HOST`` when set, else the id kept in
``<home>/host-id``, written once, the first time a process of this home asks for it. The id
written then is the hostname of that moment: a home that recorded checkpoints under its
hostname before ids were kept goes on under the same name, so nothing is detected again. Later
the hostname may change (a container restart, a home moved to another machine): the id stays,
so the host keeps its checkpoints and its queue (``ckpt.host.<id>``, one per id: :func:`in_queue`),
and the hostname is only the label status and the UI show beside it.

Without a home directory (a command that found none) nothing is written and the hostname is
the id, as before.
"""
from __future__ import annotations

import hashlib
import logging
import re
import socket
from pathlib import Path

from pipeline.durable import write_once
from pipeline.errors import ConfigError

#: The file beside the home's database and keys that holds the host id.
FILE = "host-id"
#: Longest id (``hosts.name``, ``checkpoints.host``).
MAX_LEN = 255

#: Longest id a queue name holds as it is (``ckpt.host.<id>``).
QUEUE_LEN = 100
#: An id its queue is named by as it is: the characters of queue names (Dramatiq's, Redis keys),
#: at most QUEUE_LEN of them, and no ``..`` (which marks an id that had to be changed).
_PLAIN = re.compile(rf"(?!.*\.\.)[A-Za-z0-9_.-]{{1,{QUEUE_LEN}}}")

log = logging.getLogger("ckpt.hostid")
_read: dict[tuple[str, int, int, int], str] = {}
_unwritable: set[str] = set()  # homes whose host-id could not be written: said once per process
_checked: set[str] = set()     # ids looked at (one outside the queue alphabet is said once per process)


def label() -> str:
    """What this machine is called now (its hostname): shown beside the id, never a key."""
    return socket.gethostname()


def in_queue(host: str) -> str:
    """``host`` as its queue names it: the id itself when it is plain (letters, digits, ``_``,
    ``.``, ``-``; at most QUEUE_LEN; no ``..``); else its other characters as ``_``, cut, then
    ``..`` and 12 hex digits of its SHA-256. No two ids share a queue ("gpu node 1" is not
    "gpu_node_1"): a step taken by the wrong host would send itself back to the same queue."""
    if _PLAIN.fullmatch(host):
        return host
    digest = hashlib.sha256(host.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host)[:QUEUE_LEN - 14] + ".." + digest


def host_queue(host: str) -> str:
    """The queue of the steps that must run on ``host``: ``ckpt.host.`` and the id as its queue
    names it (:func:`in_queue`). Where each step goes is pipeline/queues.py's."""
    return "ckpt.host." + in_queue(host)


def _said(host: str, where: str) -> str:
    """``host``; a warning, once per process, when its queue cannot be named by it as it is."""
    if host in _checked:
        return host
    _checked.add(host)
    if not _PLAIN.fullmatch(host):
        log.warning("host id %r (%s) is not only letters, digits, '_', '.' and '-' (at most %d, no '..'): its "
                    "queue is ckpt.host.%s. It works; an id like %r reads better, but changing a host's id "
                    "changes the host (its recorded checkpoints stay under the old id)",
                    host, where, QUEUE_LEN, in_queue(host), re.sub(r"[^A-Za-z0-9_.-]+", "-", host)[:QUEUE_LEN])
    return host


def host_id(home: Path, configured: str = "") -> str:
    """The id of this host: ``configured`` (``CKPT_HOST``), else ``<home>/host-id``, created
    with the hostname if the home exists and has none yet."""
    if configured:
        return _said(configured, "CKPT_HOST")
    path = home / FILE
    try:
        st = path.stat()
    except FileNotFoundError:
        if not home.is_dir():
            return label()  # no home: create nothing (docs/design.md, "The home")
        try:
            write_once(path, label() + "\n")
        except OSError as exc:  # a read-only home: the hostname, as before ids were kept
            if str(path) not in _unwritable:
                _unwritable.add(str(path))
                log.warning("could not write %s (%s): this host goes by its hostname %s; set CKPT_HOST to keep "
                            "it when the hostname changes", path, exc, label())
            return label()
        st = path.stat()
    key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
    if key not in _read:
        text = path.read_text(errors="replace").strip()
        if not text or len(text) > MAX_LEN or "\n" in text:
            raise ConfigError(f"{path} must hold this host's id on one line (at most {MAX_LEN} characters): the "
                              "name its checkpoints are recorded under (`ckpt status` shows them), or remove the "
                              "file to take the hostname")
        _read[key] = _said(text, str(path))
    return _read[key]
