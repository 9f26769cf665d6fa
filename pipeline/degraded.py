"""Runs whose protection through the trainer is failing: a small ledger in the home.

A trainer integration (``pipeline.protect`` from a save hook) that cannot protect a save
never raises into training (docs/design.md, "Explicit completion"); it notes the run here
instead, and ``ckpt status``, the web UI and ``/metrics`` show "run X: protection degraded
since T" until a later save of that run is recorded again.

The ledger is one small JSON file per run under ``<home>/degraded/``, not a table of the
control plane, because the control plane (its broker, its database) is often what failed.
Two processes noting the same run at once may lose one count; the first failure's time
and the newest cause are what matter.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pipeline.durable import write_private

DIR = "degraded"


@dataclass(frozen=True)
class Degraded:
    """A run whose saves are not being protected through its trainer."""

    run: str
    since: datetime  # the first failure since the run was last protected through the trainer
    last: datetime  # the newest failure
    failures: int  # saves (or checks) that failed since ``since``
    cause: str  # the newest failure, in words a user can act on

    def as_dict(self) -> dict[str, object]:
        return {"run": self.run, "since": self.since, "last": self.last, "failures": self.failures,
                "cause": self.cause}


def _file(home: Path, run: str) -> Path:
    return home / DIR / f"{hashlib.sha256(run.encode()).hexdigest()[:20]}.json"


def _read(path: Path) -> Degraded | None:
    try:
        d = json.loads(path.read_text())
        return Degraded(str(d["run"]), datetime.fromisoformat(d["since"]), datetime.fromisoformat(d["last"]),
                        int(d["failures"]), str(d["cause"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def note(home: Path, run: str, cause: str, *, at: datetime | None = None) -> Degraded | None:
    """Count one more failure of ``run`` (keeping when they began); None when there is no home
    to keep it in (a ledger never creates a home)."""
    if not home.is_dir():
        return None
    t = at or datetime.now(UTC)
    path = _file(home, run)
    old = _read(path)
    entry = Degraded(run, old.since if old else t, t, (old.failures if old else 0) + 1, cause)
    path.parent.mkdir(exist_ok=True)
    write_private(path, json.dumps({"run": run, "since": entry.since.isoformat(), "last": t.isoformat(),
                                    "failures": entry.failures, "cause": cause}))
    return entry


def clear(home: Path, run: str) -> Degraded | None:
    """``run`` is protected through its trainer again: forget its failures (what they were)."""
    path = _file(home, run)
    old = _read(path)
    path.unlink(missing_ok=True)
    return old


def listed(home: Path) -> list[Degraded]:
    """Every degraded run of this home, the longest degraded first."""
    d = home / DIR
    found = [e for p in (sorted(d.glob("*.json")) if d.is_dir() else []) if (e := _read(p)) is not None]
    return sorted(found, key=lambda e: (e.since, e.run))
