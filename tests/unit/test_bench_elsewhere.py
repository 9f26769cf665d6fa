"""bench.elsewhere: the storage workers of a confined training bench get CPUs and a weight of their
own (a machine of their own), not the root cgroups where the rest of the machine's work starves them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.elsewhere import cpu_list, cpus

CPU, CPUSET = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpuset")


def test_cpuset_lists_read_and_written():
    assert cpus("0-2,5\n") == {0, 1, 2, 5}
    assert cpus("") == set()
    assert cpu_list({3, 1}) == "1,3"


@pytest.mark.skipif(os.geteuid() != 0 or not (CPU / "cpu.shares").exists() or not (CPUSET / "cpuset.cpus").exists()
                    or len(cpus((CPUSET / "cpuset.cpus").read_text())) < 2,
                    reason="needs root, cgroup v1 cpu and cpuset hierarchies and 2 CPUs")
def test_workers_apart_get_the_other_cpus_and_the_bench_weight_then_their_cgroups_go(tmp_path):
    # Given a process confined like the training bench: one CPU, a heavy cpu.shares
    name = f"ckpt-test-{os.getpid()}"
    every = cpus((CPUSET / "cpuset.cpus").read_text())
    mine = max(every)
    (CPU / name).mkdir()
    (CPUSET / name).mkdir()
    try:
        (CPU / name / "cpu.shares").write_text("4096")
        (CPUSET / name / "cpuset.cpus").write_text(str(mine))
        (CPUSET / name / "cpuset.mems").write_text((CPUSET / "cpuset.mems").read_text().strip().split(",")[0][0])
        script = textwrap.dedent(f"""
            import os, pathlib, subprocess, time
            for h in ("{CPU}", "{CPUSET}"):
                pathlib.Path(h, "{name}", "cgroup.procs").write_text(str(os.getpid()))
            from bench.elsewhere import Elsewhere
            apart = Elsewhere()
            worker = subprocess.Popen(["sleep", "30"])
            apart.place(worker.pid)
            print(pathlib.Path(f"/proc/{{worker.pid}}/cgroup").read_text().replace("\\n", ";"))
            print([l for l in open(f"/proc/{{worker.pid}}/status") if l.startswith("Cpus_allowed_list")][0].split()[1])
            print(pathlib.Path("{CPU}", "{name}-elsewhere", "cpu.shares").read_text().strip())
            worker.terminate(); worker.wait()
            apart.remove()
        """)
        # When it starts a storage worker apart
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert out.returncode == 0, out.stderr
        groups, allowed, shares = out.stdout.splitlines()
        # Then the worker runs in the cgroups beside the bench's, on the CPUs the bench does not
        # use, weighing what the bench weighs; not in the root cgroups (every CPU, the machine's load)
        assert f":cpu:/{name}-elsewhere" in groups or f"cpu,cpuacct:/{name}-elsewhere" in groups, groups
        assert f":cpuset:/{name}-elsewhere" in groups, groups
        assert cpus(allowed) == every - {mine}
        assert shares == "4096"
        # and its cgroups are gone once it stopped
        assert not (CPU / f"{name}-elsewhere").exists() and not (CPUSET / f"{name}-elsewhere").exists()
    finally:
        for h in (CPU, CPUSET):
            for g in (h / f"{name}-elsewhere", h / name):
                if g.exists():
                    for pid in (g / "cgroup.procs").read_text().split():
                        try:
                            (h / "cgroup.procs").write_text(pid)
                        except OSError:
                            pass
                    g.rmdir()
