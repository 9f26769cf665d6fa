"""Two training hosts with disks of their own (a mount namespace each: the same path shows each
host its own files), each with its watcher and Dramatiq workers; PostgreSQL and Redis shared on
a services host; storage workers on three hosts. Both hosts write the same paths.

Checked: every checkpoint of both hosts is protected; each host rotates its own old checkpoints
from its own disk (never the other's, never "rotated" without deleting); a restore by path on a
host gives that host's checkpoint back; with one host cut off, the other's work goes on and the
cut-off host's checkpoints are left as they were (nothing superseded, vanished or rotated).
"""
from __future__ import annotations

from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import TrainingHost
from tests.checkpoints import atomic_save, state_dict
from tests.multihost.hosts import PY, TrainingHosts
from tests.multihost.lan import MARKS
from tests.processes import wait_for

pytestmark = MARKS


def test_each_host_protects_rotates_and_restores_its_own_checkpoints(tmp_path, pg_database):
    pg_name, local_url = pg_database
    upgrade(local_url)
    t = TrainingHosts(tmp_path, pg_name, local_url)
    disks, view, lan, checkpoints = t.disks, t.view, t.lan, t.checkpoints
    try:
        t.up()
        try:
            # Both hosts save the same names, with different bytes, on their own disks.
            saved: dict[tuple[str, str], bytes] = {}
            for step in (1, 2):
                for i, h in enumerate(("h1", "h2")):
                    p = atomic_save(state_dict(10 * step + i),
                                    disks[h] / "runs" / "run" / f"step_{step}.safetensors")
                    saved[(h, p.name)] = p.read_bytes()
            want = {(h, f"step_{n}.safetensors") for h in ("h1", "h2") for n in (1, 2)}
            wait_for(lambda: {k for k, (st, _c, _l) in checkpoints().items() if st in ("verified", "rotated")}
                     >= want, 120, "the four checkpoints protected")
            # keep-last 1, per host: each host's step_1 rotated, from its own disk only
            wait_for(lambda: all(checkpoints()[(h, "step_1.safetensors")][0] == "rotated" for h in ("h1", "h2")),
                     90, "each host's step_1 rotated")
            for h in ("h1", "h2"):
                assert not (disks[h] / "runs" / "run" / "step_1.safetensors").exists()
                kept = disks[h] / "runs" / "run" / "step_2.safetensors"
                assert kept.read_bytes() == saved[(h, "step_2.safetensors")]
            assert len(checkpoints()) == 4  # nothing recorded twice, nothing superseded by the other host
            with session_scope(local_url) as s:  # each host's watcher reports it in
                assert set(s.scalars(select(TrainingHost.name))) == {"h1", "h2"}
            # A restore by path on h2 gives h2's step_1 back, into h2's disk.
            r = t.run_in("h2", t.on_disk("h2", [PY, "-m", "pipeline.cli", "restore",
                                                str(view / "runs" / "run" / "step_1.safetensors"),
                                                "--to", str(view / "restored.safetensors"), "--wait"]))
            assert r.returncode == 0, r.stderr + t.log_tail()
            assert (disks["h2"] / "restored.safetensors").read_bytes() == saved[("h2", "step_1.safetensors")]
            assert not (disks["h1"] / "restored.safetensors").exists()

            # h1 is cut off: its checkpoints stay as they are; h2 goes on.
            before = {k: v for k, v in checkpoints().items() if k[0] == "h1"}
            lan.link("h1", "down")
            p = atomic_save(state_dict(99), disks["h2"] / "runs" / "run" / "step_3.safetensors")
            wait_for(lambda: checkpoints().get(("h2", p.name), (None,))[0] in ("verified", "rotated"), 120,
                     "h2's step_3 protected without h1")
            wait_for(lambda: checkpoints()[("h2", "step_2.safetensors")][0] == "rotated", 90, "h2 rotating on")
            assert {k: v for k, v in checkpoints().items() if k[0] == "h1"} == before
            kept = disks["h1"] / "runs" / "run" / "step_2.safetensors"
            assert kept.read_bytes() == saved[("h1", "step_2.safetensors")]
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{t.log_tail()}") from None
    finally:
        t.down()
