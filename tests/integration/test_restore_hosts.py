"""Restores run where the destination is (docs/design.md, "Hosts").

Given a cluster (``ckpt up``: its own host's Dramatiq) and a second training host "h2" (a real
``dramatiq pipeline.tasks`` process with ``CKPT_HOST=h2`` and its own restore root, which the
first host may not write), When a restore is asked from the first host with ``--host h2``, Then
it runs in h2's process and writes there, byte for byte; a restore to a host whose queue nothing
consumes is refused at once, non-zero, with the reason, and records nothing.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from sqlalchemy import func, select

from pipeline.db import hosts
from pipeline.db.engine import session_scope
from pipeline.db.models import Job, TrainingHost
from tests.checkpoints import atomic_save, files_of, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration


def restores(cluster) -> int:
    with session_scope(cluster.settings.db_url) as s:
        return s.scalar(select(func.count()).select_from(Job).where(Job.kind == "restore"))


def test_a_restore_runs_on_the_host_picked_and_a_host_without_consumer_is_refused(make_cluster, tmp_path_factory):
    cluster = make_cluster()
    run = cluster.runs / "r1"
    run.mkdir()
    path = atomic_save(state_dict(5), run / "step_5.safetensors")
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))
    me = cluster.settings.host_id
    with session_scope(cluster.settings.db_url) as s:  # ckpt up's Dramatiq said it consumes this host's queue
        assert hosts.consumer_seen(s, me) is not None

    refused = cluster.cli("restore", str(path), "--to", str(tmp_path_factory.mktemp("x") / "out"), "--host", "h2")
    assert refused.returncode != 0
    assert "no Dramatiq worker consumes host h2's queue" in refused.stderr and me in refused.stderr, refused.stderr
    assert restores(cluster) == 0

    h2_disk = tmp_path_factory.mktemp("h2disk")  # outside the first host's restore roots
    env = dict(cluster.env, CKPT_HOST="h2", CKPT_RESTORE_ROOTS=str(h2_disk))
    with open(cluster.tmp / "logs" / "h2.log", "ab") as log:
        h2 = subprocess.Popen([sys.executable, "-m", "dramatiq", "pipeline.tasks", "--processes", "1",
                               "--threads", "2"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def h2_consumes() -> bool:
            with session_scope(cluster.settings.db_url) as s:
                row = s.get(TrainingHost, "h2")
                return row is not None and hosts.consumer_seen(s, row.name) is not None
        wait_for(h2_consumes, 60, "h2's Dramatiq to report its consumer")
        dest = h2_disk / "restored.safetensors"
        r = cluster.cli("restore", str(path), "--to", str(dest), "--host", "h2", "--wait", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr + cluster.logs()
        assert files_of(dest) == files_of(path)
        with session_scope(cluster.settings.db_url) as s:
            job = s.scalars(select(Job).where(Job.kind == "restore")).one()
            assert job.params["host"] == "h2" and job.state == "done"
        # The first host could not have written there: the job ran in h2's process.
        local = cluster.cli("restore", str(path), "--to", str(h2_disk / "again.safetensors"))
        assert local.returncode != 0 and "outside the restore roots" in local.stderr, local.stderr
    finally:
        h2.send_signal(signal.SIGTERM)  # the master only: it stops its worker process
        try:
            h2.wait(timeout=60)
        except subprocess.TimeoutExpired:
            h2.kill()
            h2.wait()
