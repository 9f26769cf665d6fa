"""The training metrics a checkpoint carries, read at detection for the remote retention
policy's "best K" rule (pipeline.core.retention).

The HF Trainer writes ``trainer_state.json`` into each ``checkpoint-N/`` folder: its
``log_history`` holds every logged and evaluated value with the step it was logged at, and
``best_metric`` the value of ``metric_for_best_model`` at the best checkpoint so far. A
checkpoint's metrics are the latest value of each name logged at or before its step
(``global_step``). Nothing here fails a detection: a missing, huge or malformed file means
no metrics.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("ckpt.detect")

STATE_FILE = "trainer_state.json"
#: A trainer_state.json larger than this is not read (a month of logging is a few MB).
MAX_BYTES = 64 * 1024 * 1024


def read(files: Iterable[tuple[str, str, int]]) -> dict[str, float]:
    """Metrics of a checkpoint from its files ``(relpath, abspath, size)``; empty if none."""
    return from_trainer_state(trainer_state(files))


def trainer_state(files: Iterable[tuple[str, str, int]]) -> Any:
    """The parsed ``trainer_state.json`` among ``files``, or None (missing, huge, malformed)."""
    for relpath, abspath, size in files:
        if relpath != STATE_FILE or size > MAX_BYTES:
            continue
        try:
            with open(abspath, "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError) as exc:
            log.info("%s: no metrics (%s)", abspath, exc)
            return None
    return None


def writer_step(doc: Any) -> int | None:
    """The step the trainer says it saved at (``global_step``), or None."""
    step = doc.get("global_step") if isinstance(doc, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**62 else None


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def from_trainer_state(doc: Any) -> dict[str, float]:
    """The latest value of every numeric name logged at or before ``global_step``."""
    if not isinstance(doc, dict):
        return {}
    step = _number(doc.get("global_step"))
    out: dict[str, float] = {}
    history = doc.get("log_history")
    for entry in history if isinstance(history, list) else []:
        if not isinstance(entry, dict):
            continue
        at = _number(entry.get("step"))
        if step is not None and at is not None and at > step:
            continue
        for name, value in entry.items():
            number = _number(value)
            if number is not None and name not in ("step", "epoch") and isinstance(name, str) and len(name) <= 128:
                out[name] = number
    best = _number(doc.get("best_metric"))
    if best is not None:
        out["best_metric"] = best
    return out
