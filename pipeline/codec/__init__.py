"""Byte-grouped compression of tensor data (docs/design.md, "Byte-grouped compression").

:mod:`~pipeline.codec.segments` says which bytes of a safetensors range hold which dtype,
:mod:`~pipeline.codec.planes` splits elements into byte planes and back, and
:mod:`~pipeline.codec.frames` writes and reads the self-describing frames, one per block.
"""
from __future__ import annotations

import threading

_warmed = threading.Event()
_lock = threading.Lock()
_started = False


def warm() -> None:
    """Load what splitting and merging planes needs (numpy: about 0.2 CPU-seconds here) now,
    rather than in the first transfer of this process that sends or receives a planes frame.
    Where frames are coming (a storage host, a trainer whose workers are on other hosts), a
    process that loads it at start keeps the cost out of the first checkpoint's store and
    restore; one that never sees frames (a single-host cluster sends over loopback as it is)
    never loads it."""
    if _warmed.is_set():
        return
    with _lock:
        import numpy  # noqa: F401

        from pipeline.codec import frames  # noqa: F401

        _warmed.set()


def warm_soon() -> None:
    """:func:`warm` in a daemon thread, once (a request handler that found frames are coming)."""
    global _started
    with _lock:
        if _warmed.is_set() or _started:
            return
        _started = True
    threading.Thread(target=warm, name="ckpt-codec-warm", daemon=True).start()
