"""Checkpoints a trainer's recorder is recording now, so that the watcher does not hash them a
second time (docs/design.md, "Explicit completion").

A declared save is hashed by the trainer's recorder (pipeline/recorder.py) at once; the watcher
finds the same folder complete a moment later. Without a word between them both hashed it: on
the training host, a second pass over every byte of every save. The recorder holds a *claim*
while it records, a file ``<home>/declared/<digest>.json`` naming the path and the recorder's
process (pipeline/liveness.py: pid and start time); the watcher leaves a claimed path alone and
looks again shortly, then finds it recorded. A claim whose process is gone, or older than
``MAX_SECONDS`` (10 minutes), holds nothing (and is removed): the watcher stays the safety net.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline import liveness
from pipeline.durable import write_private

#: A claim older than this holds nothing, whatever its process: a recorder stuck (a lock, a hung
#: disk) delays the watcher's safety net at most this long; a record that really takes longer (a
#: save of hundreds of GB) is then hashed by both, as before claims.
MAX_SECONDS = 600.0


def _file(home: Path, host: str, path: str) -> Path:
    digest = hashlib.sha256(f"{host}\0{os.path.abspath(path)}".encode()).hexdigest()[:32]
    return home / "declared" / f"{digest}.json"


@contextlib.contextmanager
def claim(home: Path, host: str, path: str) -> Iterator[None]:
    """Hold the claim on ``path`` of ``host`` while the block runs (this process records it)."""
    f = _file(home, host, path)
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        write_private(f, json.dumps({"path": os.path.abspath(path), "at": time.time(), **liveness.stamp()}))
    except OSError:  # no claim: the watcher may hash it too, as it did before claims
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            f.unlink()


def held(home: Path, host: str, path: str) -> bool:
    """Whether a live recorder is recording ``path`` of ``host`` now."""
    f = _file(home, host, path)
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    stale = (doc.get("path") != os.path.abspath(path) or time.time() - float(doc.get("at", 0)) > MAX_SECONDS
             or liveness.gone(int(doc.get("pid", 0)), str(doc.get("process", ""))) is not None)
    if stale:
        with contextlib.suppress(OSError):
            f.unlink()
    return not stale
