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

import hashlib
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint, CheckpointPart, DetectionProblem
from pipeline.detection.catalog import latest_store_job
from tests.multihost import dcp_rank
from tests.multihost.hosts import PY, TrainingHosts
from tests.multihost.lan import MARKS
from tests.processes import wait_for

pytestmark = MARKS
RANK_HOSTS = ("h1", "h2")  # rank 0, the coordinator, on h1


def save_step(t: TrainingHosts, out: Path, step: int, seed: int = 0) -> None:
    """Both ranks save ``step`` to ``out``, each in its own host's namespace, on its own disk."""
    ranks = []
    for rank, h in enumerate(RANK_HOSTS):
        env = dict(t.env(h), GLOO_SOCKET_IFNAME="eth0")
        argv = [PY, "-m", "tests.multihost.dcp_rank", str(rank), "2", t.lan.addr["h1"], "29517", str(out),
                str(step), str(seed)]
        ranks.append(t.lan.run(h, t.on_disk(h, argv), env, t.logs / f"rank{rank}-step{step}-seed{seed}.log"))
    for p in ranks:
        assert p.wait(timeout=120) == 0, t.log_tail()


def current_version(url: str, name: str) -> dict | None:
    """The current checkpoint called ``name``: its id, host, layout and each file's host."""
    with session_scope(url) as s:
        c = s.scalar(select(Checkpoint).where(Checkpoint.name == name, Checkpoint.current.is_(True)))
        return None if c is None else {"id": c.id, "host": c.host, "layout": c.layout,
                                       "files": {f.relpath: f.host for f in c.files}}


def test_a_dcp_step_saved_on_two_hosts_is_one_checkpoint(tmp_path, pg_database):
    pg_name, local_url = pg_database
    upgrade(local_url)
    t = TrainingHosts(tmp_path, pg_name, local_url, runs=("dcp",))
    step_dir = t.view / "runs" / "dcp"

    def save(step: int) -> None:
        save_step(t, step_dir / f"step_{step}", step)

    def recorded(name: str) -> dict | None:
        return current_version(local_url, name)

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
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{t.log_tail()}") from None
    finally:
        t.down()


def versions(url: str, name: str) -> dict[int, dict]:
    """Every recorded version called ``name``, by id: current, store state, released, the
    changed-on-disk flag, and each file's (host, SHA-256)."""
    with session_scope(url) as s:
        out = {}
        for c in s.scalars(select(Checkpoint).where(Checkpoint.name == name)):
            job = latest_store_job(s, c.id)
            out[c.id] = {"current": c.current, "state": job.state if job else None,
                         "released": c.released_at is not None, "disk_changed": c.disk_changed,
                         "files": {f.relpath: (f.host, f.sha256) for f in c.files}}
        return out


def loads(t: TrainingHosts, restored: Path, step: int, seed: int) -> bool:
    """Whether ``dcp.load`` of the restored folder gives both ranks' tensors of ``step`` saved with ``seed``."""
    want = {**dcp_rank.state(0, step, seed), **dcp_rank.state(1, step, seed)}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=str(restored))
    return all(torch.equal(got[k], want[k]) for k in want)


def test_a_dcp_step_saved_again_from_two_hosts_waits_for_each_hosts_new_part(tmp_path, pg_database):
    """Issue 27's row: a torch DCP step saved from two hosts, then saved again at the same path
    (the job restarts after a crash and redoes the step) while h2's watcher is away. h1 holds
    the new ``.metadata`` and rank 0's new file; the only part h2 announced is the old save's.
    h1 must not record the new save with h2's stale part (that superseded and released the
    protected version, and the mix was never protected): the old version stays current and
    protected, flagged CHANGED ON DISK, a restore by path refuses (by id gives the old version),
    and a restart of h1's watcher changes nothing. Once h2's watcher is back and announces its
    new part, the new save is one checkpoint of both hosts' new files, protected, and restored
    by path it loads the new tensors."""
    pg_name, local_url = pg_database
    upgrade(local_url)
    t = TrainingHosts(tmp_path, pg_name, local_url, runs=("dcp",))
    path = t.view / "runs" / "dcp" / "step_2"
    h2_part = t.disks["h2"] / "runs" / "dcp" / "step_2" / "__1_0.distcp"

    def watcher_of(h: str):
        return next(p for p in t.lan.procs if "watch" in p.args and t.lan.ns[h] in p.args and p.poll() is None)

    def stop_watcher(h: str) -> None:
        w = watcher_of(h)
        w.send_signal(signal.SIGTERM)
        w.wait(timeout=30)

    def restore(ref: str | int, to: str) -> subprocess.CompletedProcess:
        return t.run_in("h1", t.on_disk("h1", [PY, "-m", "pipeline.cli", "restore", str(ref), "--to",
                                               str(t.view / to), "--wait"]))

    try:
        t.up()
        try:
            save_step(t, path, 2, seed=0)
            wait_for(lambda: any(v["state"] == "verified" for v in versions(local_url, "step_2").values()), 120,
                     "step_2 protected")
            [(old, v)] = versions(local_url, "step_2").items()
            assert v["current"] and v["files"]["__1_0.distcp"][0] == "h2"
            old_h2_sha = v["files"]["__1_0.distcp"][1]

            stop_watcher("h2")  # h2 cannot announce its new part for now
            save_step(t, path, 2, seed=1)  # the restarted job saves step_2 again, other tensors
            assert hashlib.sha256(h2_part.read_bytes()).hexdigest() != old_h2_sha
            wait_for(lambda: versions(local_url, "step_2")[old]["disk_changed"], 60, "step_2 flagged changed on disk")

            def stale_phase_holds() -> None:
                vs = versions(local_url, "step_2")
                assert list(vs) == [old], vs  # the new save is not recorded (with h2's stale part)
                assert vs[old]["current"] and vs[old]["state"] == "verified" and not vs[old]["released"], vs
                assert vs[old]["disk_changed"], vs

            time.sleep(5)  # several scans of h1's watcher
            stale_phase_holds()
            stop_watcher("h1")  # ... and h1's watcher restarted: still not recorded, still flagged
            t.watcher("h1")
            time.sleep(8)
            stale_phase_holds()

            status = t.run_in("h1", [PY, "-m", "pipeline.cli", "status"])
            assert status.returncode == 0, status.stderr
            assert "CHANGED ON DISK" in status.stdout, status.stdout
            refused = restore(str(path), "by-path")
            assert refused.returncode != 0 and "changed on disk" in refused.stderr, refused.stdout + refused.stderr
            assert f"ckpt restore {old}" in refused.stderr, refused.stderr
            assert not (t.disks["h1"] / "by-path").exists()
            by_id = restore(old, "by-id")  # the protected version, named by id: the old save, whole
            assert by_id.returncode == 0, by_id.stderr
            assert loads(t, t.disks["h1"] / "by-id", 2, seed=0)

            t.watcher("h2")  # h2 announces its new part: the new save is complete and recorded
            wait_for(lambda: any(v["current"] and v["state"] == "verified"
                                 for i, v in versions(local_url, "step_2").items() if i != old), 120,
                     "the new step_2 protected")
            vs = versions(local_url, "step_2")
            [new] = [i for i, v in vs.items() if v["current"]]
            assert vs[old]["state"] == "superseded" and vs[old]["released"], vs
            assert vs[new]["disk_changed"] is None, vs
            assert {r: h for r, (h, _) in vs[new]["files"].items()} == {
                ".metadata": None, "__0_0.distcp": None, "__1_0.distcp": "h2"}
            assert vs[new]["files"]["__1_0.distcp"][1] == hashlib.sha256(h2_part.read_bytes()).hexdigest()

            r = restore(str(path), "by-path-new")
            assert r.returncode == 0, r.stderr
            assert loads(t, t.disks["h1"] / "by-path-new", 2, seed=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{t.log_tail()}") from None
    finally:
        t.down()
