"""What both trainer integrations share: find the home once and say what is protected (or
why not), declare each save without ever raising into training, and hold the trainer's own
deletion of a save only while protection works (docs/design.md, section 7).
"""
from __future__ import annotations

import json
import logging
import os
import time

from pipeline import api, liveness
from pipeline.detection import roots
from pipeline.errors import NotProtectedYet, OutsideRoots
from pipeline.protector import NoHome, explain, run_of, settings_here
from pipeline.settings import Settings

log = logging.getLogger("ckpt.integrations")


def _visible() -> None:
    """Print ``ckpt:`` lines on stderr when the training script set up no logging (as
    Lightning does for its own); checked at train start, after the script's own setup."""
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


#: How often a wait before the trainer deletes a save looks whether ``ckpt up`` is still there.
WAIT_SLICE = 5.0


def up_gone(settings: Settings | None) -> str | None:
    """Why waiting for protection is pointless: the ``ckpt up`` of this home (on this machine)
    is gone, its ``up.json`` left by a crash (its pid free, or now another process's:
    pipeline/liveness.py). None while it runs, or where there is none to ask."""
    try:
        s = settings or settings_here()
        up = json.loads((s.home / "up.json").read_text())
        pid, process = int(up["pid"]), str(up.get("process", ""))
    except Exception:  # no home, no up.json (a deployment's remote control plane): keep waiting
        return None
    why = liveness.gone(pid, process)
    return None if why is None else f"the `ckpt up` of home {s.home} (pid {pid}) {why}"


class TrainerProtection:
    """One trainer's protection: :meth:`start` once, :meth:`saved` per save, :meth:`before_delete`
    before the trainer deletes a save of its own. None of them raises."""

    def __init__(self, settings: Settings | None) -> None:
        self.settings = settings
        self.enabled, self.started = True, False
        self._said: set[str] = set()  # runs whose waiting trouble was logged

    def start(self, run_dir: str) -> None:
        """Say once, at train start, where the trainer's saves are protected and through which
        home, or why they are not (then no save is declared: there is nowhere to record it)."""
        if self.started:
            return
        self.started = True
        _visible()
        run = os.path.abspath(run_dir)
        try:
            s = self.settings or settings_here()
        except NoHome as exc:
            self.enabled = False
            log.warning("ckpt: not protecting %s through the trainer: %s", run, exc)
            return
        except Exception as exc:  # a config.toml that does not parse: say it, train on
            self.enabled = False
            log.warning("ckpt: not protecting %s through the trainer: %s", run, explain(exc, None))
            return
        try:
            roots.locate(os.path.join(run, "checkpoint-0"), s.roots)
        except OutsideRoots as exc:  # said once and noted; each save tries again (roots may come)
            api.protector().failed(run, exc, s)
            return
        log.info("ckpt: protecting runs under %s via home %s", ", ".join(s.roots), s.home)

    def saved(self, path: str) -> None:
        """The trainer finished writing ``path``: declare it (recorded in the background)."""
        if self.enabled:
            try:
                api.protect(path, settings=self.settings)
            except Exception as exc:
                api.protector().failed(run_of(path), exc, self.settings)

    def before_delete(self, path: str, timeout: float) -> None:
        """Wait until ``path`` is protected before the trainer deletes it, unless protection of
        its run is failing (then waiting would only stall training)."""
        if not self.enabled:
            return
        run = run_of(path)
        if api.protector().failing(run):
            self._once(run, "ckpt: not waiting for the saves of %s to be protected before the trainer deletes "
                       "them: its protection is degraded", run)
            return
        deadline = time.monotonic() + timeout
        while True:
            try:  # in slices: a `ckpt up` that dies meanwhile ends the wait, not the timeout
                api.wait_protected(path, timeout=min(WAIT_SLICE, max(deadline - time.monotonic(), 0)),
                                   settings=self.settings)
                return
            except NotProtectedYet as exc:
                gone = up_gone(self.settings)
                if gone is None and time.monotonic() < deadline:
                    continue
                why = gone or str(exc)
            except Exception as exc:
                why = explain(exc, self.settings)
            self._once(run, "ckpt: %s may be deleted by the trainer before it is protected: %s", path, why)
            return

    def _once(self, run: str, msg: str, *args: object) -> None:
        if run not in self._said:
            self._said.add(run)
            log.warning(msg, *args)
