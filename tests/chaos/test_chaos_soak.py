"""The chaos soak (issue 28) in the default suite: 3 minutes of the cluster in a box
(bench/chaos) and its object store (SeaweedFS behind a front the faults partition and throttle)
under a seeded fault schedule, a few MB per save; ``--chaos-minutes N`` runs it longer. It fails
with every finding listed: an unprotected or lost save, an unsafe local deletion (checked from
the workers' disks, and for the ``required`` run from the bucket, at the moment it happened), a
protected save whose shards the bucket does not hold after the heal, an object-store copy given
up, a job stuck beyond
lease x 3 after the heal, Redis memory or queue depth out of bounds, a healthy worker not up at
the end, a restore that is not byte-identical. Every namespace, mount and process the soak
made is removed, also when it fails (bench/chaos/box.py, ``ChaosBox.down``)."""
from __future__ import annotations

import os
import shutil

import pytest

from bench.chaos.soak import Soak, save_doc, small
from bench.cluster import missing

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(missing() is not None or not shutil.which("mkfs.ext4"),
                       reason=f"{missing() or 'needs mkfs.ext4'} (the chaos soak's box)"),
]


@pytest.mark.timeout(0)
def test_cluster_heals_after_every_fault_and_loses_nothing(tmp_path, chaos_minutes, request):
    seed = int(os.environ.get("CKPT_CHAOS_SEED", "28"))
    config = small(chaos_minutes or 3.0, seed)
    config.root = tmp_path / "soak"
    config.root.mkdir()
    result = Soak(config).run()
    save_doc(result.doc, request.config.rootpath / ".pytest_cache" / "chaos-soak.json")
    print(result.report)
    assert result.ok, f"chaos soak (seed {seed}) failed:\n" + result.report
