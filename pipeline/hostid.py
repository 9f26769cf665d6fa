"""This machine's identity among the training hosts (docs/design.md, "Hosts").

A host is named by an id, not by its hostname: ``CKPT_HOST`` when set, else the id kept in
``<home>/host-id``, written once, the first time a process of this home asks for it. The id
written then is the hostname of that moment: a home that recorded checkpoints under its
hostname before ids were kept goes on under the same name, so nothing is detected again. Later
the hostname may change (a container restart, a home moved to another machine): the id stays,
so the host keeps its checkpoints and its queue (``ckpt.host.<id>``), and the hostname is only
the label status and the UI show beside it.

Without a home directory (a command that found none) nothing is written and the hostname is
the id, as before.
"""
from __future__ import annotations

import logging
import socket
from pathlib import Path

from pipeline.durable import write_once
from pipeline.errors import ConfigError

#: The file beside the home's database and keys that holds the host id.
FILE = "host-id"
#: Longest id (``hosts.name``, ``checkpoints.host``).
MAX_LEN = 255

log = logging.getLogger("ckpt.hostid")
_read: dict[tuple[str, int, int, int], str] = {}
_unwritable: set[str] = set()  # homes whose host-id could not be written: said once per process


def label() -> str:
    """What this machine is called now (its hostname): shown beside the id, never a key."""
    return socket.gethostname()


def host_id(home: Path, configured: str = "") -> str:
    """The id of this host: ``configured`` (``CKPT_HOST``), else ``<home>/host-id``, created
    with the hostname if the home exists and has none yet."""
    if configured:
        return configured
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
        _read[key] = text
    return _read[key]
