"""One torch DCP step written by ranks on two hosts, each to its own disk (docs/design.md, "One
checkpoint, several hosts"): rank 0 on h1 writes its ``.distcp`` and, last, ``.metadata``; rank
1 on h2 writes its ``.distcp`` at the same path on h2's disk. Real ``torch.distributed`` (gloo
over the LAN in a box), real watchers and Dramatiq on each host, PostgreSQL and Redis shared.

Checked: while h2's watcher is away, h1 does not record the step (its ``.metadata`` names a file
no host has announced) and says why; once h2 announces its part, the step is one checkpoint of
both hosts' files, protected as one; a newer step rotates it on both disks; restored on h1 into
one directory, ``dcp.load`` reads every rank's tensors back.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed.checkpoint as dcp
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint, CheckpointPart, DetectionProblem
from tests.multihost import dcp_rank
from tests.multihost.hosts import PY, TrainingHosts
from tests.multihost.lan import MARKS
from tests.processes import wait_for

pytestmark = MARKS
RANK_HOSTS = ("h1", "h2")  # rank 0, the coordinator, on h1


def test_a_dcp_step_saved_on_two_hosts_is_one_checkpoint(tmp_path, pg_database):
    pg_name, local_url = pg_database
    upgrade(local_url)
    t = TrainingHosts(tmp_path, pg_name, local_url, runs=("dcp",))
    step_dir = t.view / "runs" / "dcp"

    def save(step: int) -> None:
        """Both ranks save ``step_<step>``, each in its own host's namespace, on its own disk."""
        ranks = []
        for rank, h in enumerate(RANK_HOSTS):
            env = dict(t.env(h), GLOO_SOCKET_IFNAME="eth0")
            argv = [PY, "-m", "tests.multihost.dcp_rank", str(rank), "2", t.lan.addr["h1"], "29517",
                    str(step_dir / f"step_{step}"), str(step)]
            ranks.append(t.lan.run(h, t.on_disk(h, argv), env, t.logs / f"rank{rank}-step{step}.log"))
        for p in ranks:
            assert p.wait(timeout=120) == 0, t.log_tail()

    def recorded(name: str) -> dict | None:
        """The current checkpoint called ``name``: its id, host, layout and each file's host."""
        with session_scope(local_url) as s:
            c = s.scalar(select(Checkpoint).where(Checkpoint.name == name, Checkpoint.current.is_(True)))
            return None if c is None else {"id": c.id, "host": c.host, "layout": c.layout,
                                           "files": {f.relpath: f.host for f in c.files}}

    def problem(name: str) -> str | None:
        with session_scope(local_url) as s:
            return s.scalar(select(DetectionProblem.reason).where(DetectionProblem.path.like(f"%/{name}"),
                                                                  DetectionProblem.host == "h1"))

    try:
        t.up()
        try:
            h2_watcher = next(p for p in t.lan.procs if "watch" in p.args and t.lan.ns["h2"] in p.args)
            h2_watcher.send_signal(signal.SIGTERM)  # h2's part cannot be announced for now
            h2_watcher.wait(timeout=30)
            save(1)
            wait_for(lambda: problem("step_1") is not None, 60, "h1 saying why step_1 is not recorded")
            assert "__1_0.distcp" in problem("step_1") and "no other host announced it" in problem("step_1")
            assert recorded("step_1") is None  # not protected with h2's rank missing

            t.watcher("h2")  # h2 announces its part: the step is complete, one checkpoint of both
            wait_for(lambda: t.checkpoints().get(("h1", "step_1"), (None,))[0] == "verified", 120,
                     "step_1 protected")
            c = recorded("step_1")
            assert c is not None and (c["host"], c["layout"]) == ("h1", "torch-dcp")
            assert c["files"] == {".metadata": None, "__0_0.distcp": None, "__1_0.distcp": "h2"}
            assert set(t.checkpoints()) == {("h1", "step_1")}  # h2's part is not a checkpoint of its own
            wait_for(lambda: problem("step_1") is None, 30, "h1's problem cleared")

            save(2)  # keep-last 1: step_1 goes from both disks, once step_2 is protected
            wait_for(lambda: t.checkpoints().get(("h1", "step_1"), (None,))[0] == "rotated", 120,
                     "step_1 rotated")
            wait_for(lambda: not (t.disks["h2"] / "runs" / "dcp" / "step_1").exists(), 60,
                     "h2's part of step_1 removed from h2's disk")
            assert not (t.disks["h1"] / "runs" / "dcp" / "step_1").exists()
            assert sorted(p.name for p in (t.disks["h2"] / "runs" / "dcp" / "step_2").iterdir()) == ["__1_0.distcp"]
            with session_scope(local_url) as s:
                held = {(p.host, p.path.rsplit("/", 1)[-1]): p.local_present for p in s.scalars(select(CheckpointPart))}
            assert held == {("h2", "step_1"): False, ("h2", "step_2"): True}

            # Restored on h1 into one directory: dcp.load reads both ranks' tensors.
            r = t.run_in("h1", t.on_disk("h1", [PY, "-m", "pipeline.cli", "restore", str(c["id"]),
                                                "--to", str(t.view / "restored"), "--wait"]))
            assert r.returncode == 0, r.stderr + t.log_tail()
            restored = t.disks["h1"] / "restored"
            assert sorted(p.name for p in restored.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
            want = {**dcp_rank.state(0, 1), **dcp_rank.state(1, 1)}
            got = {k: torch.zeros_like(v) for k, v in want.items()}
            dcp.load(got, checkpoint_id=str(restored))
            assert all(torch.equal(got[k], want[k]) for k in want)
        except AssertionError:
            raise AssertionError(t.log_tail()) from None
    finally:
        t.down()
