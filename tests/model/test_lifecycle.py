"""A model-based test of the whole lifecycle (issue 27): generated histories of saves in every
writer's layout, re-saves, killed saves, the trainer's and the user's deletions, pins, forgets,
policies, collection, damaged copies and restores, in any message order, with the invariants
checked after every step (tests/model/world.py says which).

Bounded by default (a fixed set of histories, under two minutes with the workers' start);
``--model-soak MINUTES`` runs fresh random histories for that long instead, and shrinks a
failing one. A failing history is printed rule by rule (and the World's own history of what
happened); it becomes an explicit sequence in test_regressions.py.
"""
from __future__ import annotations

import json
import time

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.model.machine import Lifecycle
from tests.model.world import WorldStats

#: The default run: a fixed set of histories (derandomized), reported as found (not shrunk: a
#: shrink can take minutes; ``--model-soak`` shrinks).
BOUNDED = dict(max_examples=40, stateful_step_count=36,
               phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target))
SOAK = dict(max_examples=20, stateful_step_count=60)


def _settings(derandomize: bool, **kw) -> settings:
    return settings(deadline=None, database=None, derandomize=derandomize, print_blob=True,
                    suppress_health_check=list(HealthCheck), **kw)


def test_lifecycle_keeps_every_invariant(model_workers, model_soak, tmp_path, request):
    Lifecycle.workers, Lifecycle.base = model_workers, tmp_path
    Lifecycle.totals, Lifecycle.examples = WorldStats(), 0
    started = time.monotonic()
    try:
        if not model_soak:
            run_state_machine_as_test(Lifecycle, settings=_settings(True, **BOUNDED))
        else:
            while time.monotonic() - started < model_soak * 60:
                run_state_machine_as_test(Lifecycle, settings=_settings(False, **SOAK))
    finally:
        t = Lifecycle.totals
        summary = {"examples": Lifecycle.examples, "steps": t.steps, "messages": t.messages,
                   "restores": t.restores, "removed_by_system": t.removed_by_system,
                   "longest_history": t.longest, "seconds": round(time.monotonic() - started, 1)}
        line = "model lifecycle: " + ", ".join(f"{k} {v}" for k, v in summary.items())
        print("\n" + line)
        out = request.config.rootpath / ".pytest_cache" / "model-lifecycle.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(summary))
