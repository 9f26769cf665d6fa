"""Readiness of the services ``ckpt up`` starts: each says so once it does its work.

``ckpt up`` gives its children a directory (the ``ready_dir`` setting); a service writes
``<name>.<pid>`` there once it is working (the watcher after its first scan, which hands the
checkpoints it found complete to its hashers and does not wait for them; the scheduler
after its first tick, each Dramatiq worker process once booted), and ``ckpt up`` prints
"ready" only when every one of them did and the web UI answers HTTP.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.settings import Settings


def mark_ready(settings: Settings, name: str) -> None:
    """Say that this process (service ``name``) is working; nothing outside ``ckpt up``."""
    if not settings.ready_dir:
        return
    directory = Path(settings.ready_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.{os.getpid()}").write_text("")


def ready(directory: Path, name: str, pids: set[int] | None = None) -> int:
    """How many processes of service ``name`` said they are ready (among ``pids`` if given)."""
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return 0
    count = 0
    for entry in entries:
        service, _, pid = entry.rpartition(".")
        if service == name and pid.isdigit() and (pids is None or int(pid) in pids):
            count += 1
    return count
