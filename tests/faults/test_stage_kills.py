"""SIGKILL of the Dramatiq worker at every stage boundary of store, rotate, restore, scrub, repair.

The boundaries are not listed by hand: a traced run of each operation records every
failpoint it passes (each commit point, before and after, of each actor), and each one
becomes a fault: the worker is killed there, comes back, and the job must still end well
with every invariant kept.
"""
from __future__ import annotations

import re

import pytest

from tests.faults.harness import FaultCluster, Table, Trace, trial

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

COMMIT = re.compile(r"^(\w+)\.commit\d+\.(before|after)$")


def points(names: list[str], actors: set[str]) -> list[str]:
    return [n for n in names if (m := COMMIT.match(n)) and m.group(1) in actors]


def run_faults(cluster: FaultCluster, names: list[str], trials: int, fire, where=None,
               trace: Trace | None = None) -> list[str]:
    if trace is not None and trials == 1:  # soak mode (--soak N) also kills at every round of a loop
        names = trace.places(names)
    bad = []
    for name in names:
        row = Table.row(f"SIGKILL dramatiq worker at {name}" if where is None else f"SIGKILL {where} at {name}")
        for _ in range(trials):
            cluster.arm(name, "kill", where)
            trial(cluster, row, fire, name, where)
        if not row.ok:
            bad.append(f"{row.fault}: {row.problems[:3]} integrity {row.integrity_ok}")
    return bad


def test_store_and_rotate(fault_cluster: FaultCluster, trials: int):
    c = fault_cluster
    with c.trace() as t:
        c.new_checkpoint()
        c.quiet()
        c.new_checkpoint()  # its verification rotates the first
        c.quiet()
    names = ["watch.recorded", *points(t.names, {"shard", "replicate", "verify", "rotate_run", "rotate"})]
    # The trace itself is checked: a failpoint layer that fired nothing would prove nothing.
    assert {"shard.commit2.before", "replicate.commit2.after", "verify.commit2.before",
            "rotate.commit3.before", "rotate.commit3.after"} <= set(names), t.names
    assert not run_faults(c, names, trials, c.new_checkpoint, trace=t)


def test_restore(fault_cluster: FaultCluster, trials: int, tmp_path):
    c = fault_cluster
    src = c.new_checkpoint()
    c.quiet()
    n = 0

    def restore() -> None:
        nonlocal n
        n += 1
        dest = tmp_path / f"restored_{n}.safetensors"
        job = c.restore(src, dest)
        if job.state != "done" or dest.read_bytes() != src.read_bytes():
            problems.append(f"restore {n}: {job.state}, {job.last_error}")
        leftovers = [p.name for p in tmp_path.iterdir() if ".ckpt-restore-" in p.name]
        if leftovers:
            problems.append(f"restore {n}: staging left behind: {leftovers}")

    problems: list[str] = []
    with c.trace() as t:
        restore()
    names = points(t.names, {"restore"})
    assert {"restore.commit1.after", "restore.commit2.before", "restore.commit3.before"} <= set(names), t.names
    assert not run_faults(c, names, trials, restore, trace=t)
    assert not problems


def corrupt_one_replica(c: FaultCluster) -> None:
    """Flip a byte of one shard file on the first worker (on-disk rot)."""
    files = sorted(p for p in (c.workers[0].data / "shards").rglob("*") if p.is_file())
    victim = files[c.step % len(files)]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))


def test_scrub_and_repair(fault_cluster: FaultCluster, trials: int):
    c = fault_cluster
    c.new_checkpoint()
    c.quiet()

    def scrub() -> None:
        assert c.scrub_now()

    def rot_then_scrub() -> None:
        corrupt_one_replica(c)
        scrub()

    with c.trace() as t:
        scrub()
        c.quiet()
    names = points(t.names, {"scrub"})
    assert {"scrub.commit1.after", "scrub.commit2.before", "scrub.commit3.after"} <= set(names), t.names
    bad = run_faults(c, names, trials, scrub, trace=t)

    with c.trace() as t:
        rot_then_scrub()
        c.quiet()
    assert c.check().torn == 0  # the rotten copy was quarantined and rebuilt
    names = points(t.names, {"repair"})
    assert {"repair.commit1.after", "repair.commit2.before"} <= set(names), t.names
    bad += run_faults(c, names, trials, rot_then_scrub, trace=t)

    # A storage worker killed while it re-hashes for a scrub.
    bad += run_faults(c, ["worker.verify.rehash"], trials, scrub, where="worker1")
    assert not bad
