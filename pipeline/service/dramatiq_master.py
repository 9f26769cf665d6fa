"""``python -m pipeline.service.dramatiq_master ARGS``: Dramatiq's own command (``dramatiq ARGS``,
``ckpt up`` runs it as ``... pipeline.tasks --processes N``), its worker processes forked with
the steps' modules already imported.

Dramatiq's master forks its worker processes and each imports the broker's module, here
``pipeline.tasks``: SQLAlchemy, the models, redis and every step, about a second of CPU per
process, all of them at once on a host whose training is starting too. The master imports the
steps' modules once before it forks, so each worker process finds them imported and only
installs its broker and declares the actors (milliseconds). ``pipeline.tasks`` itself is not
imported here: its broker (its Redis connections, its broker id, by which Dramatiq tells a dead
worker's messages apart) and its consumer heartbeat thread are each worker process's own, made
after the fork. ``tests/unit/test_layout.py`` checks that :data:`PRELOADED` is what
``pipeline.tasks`` needs.
"""
from __future__ import annotations

import importlib
import sys

#: What ``pipeline.tasks`` imports, outside the package itself.
PRELOADED = (
    "dramatiq.brokers.redis", "dramatiq.brokers.stub", "dramatiq.middleware", "dramatiq.cli",
    "pipeline.service.lifetime", "pipeline.queues", "pipeline.deliveries", "pipeline.consumers",
    "pipeline.db.engine", "pipeline.integrity.gc", "pipeline.integrity.reconcile", "pipeline.integrity.repair",
    "pipeline.integrity.scrub", "pipeline.restoring.job", "pipeline.store.replication", "pipeline.store.rotation",
    "pipeline.store.sharding", "pipeline.store.verification",
)


def preload() -> None:
    for name in PRELOADED:
        importlib.import_module(name)


def main() -> int:
    preload()
    from dramatiq.cli import main as dramatiq_main

    sys.argv = ["dramatiq", *sys.argv[1:]]
    return int(dramatiq_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
