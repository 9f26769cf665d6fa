"""The "other machines" of a confined training bench: cgroups of their own for the storage workers.

A bench confined as a one-core training host (docs/benchmarks.md, "As a dedicated one-core
training host": a cpuset cgroup on CPU 1 in a cpu cgroup whose ``cpu.shares`` outweigh the rest
of the machine) starts the storage workers of its "workers elsewhere" rows apart from itself.
The root of each hierarchy is no other machine: its cpuset holds every CPU, the training one
too, where a worker weighs 1,024 against the training group's 262,144, and on the others it
weighs as much as any task of anyone's work on the machine. Its progress then follows the rest of
the machine, not the pipeline. So the workers get a sibling pair of cgroups,
``<name>-elsewhere``: the CPUs the bench is not confined to and the bench's own ``cpu.shares``
(what a machine of their own would give them), removed once they have stopped.
"""
from __future__ import annotations

import os
from pathlib import Path

#: cgroup v1 hierarchies a confined bench is placed in.
CGROUPS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpuset")
SUFFIX = "-elsewhere"


def cpus(text: str) -> set[int]:
    """The CPUs of a cpuset list (``0-2,5``)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            out.update(range(int(first), int(last or first) + 1))
    return out


def cpu_list(numbers: set[int]) -> str:
    return ",".join(str(n) for n in sorted(numbers))


def confined_in(hierarchy: str, pid: int | None = None) -> str | None:
    """The cgroup of process ``pid`` (default: this one) in ``hierarchy``, None at its root."""
    name = Path(hierarchy).name
    for line in Path(f"/proc/{pid or os.getpid()}/cgroup").read_text().splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3 and name in fields[1].split(",") and fields[2].strip() != "/":
            return fields[2].strip()
    return None


class Elsewhere:
    """The cgroups of the storage workers that stand for other machines (created on :meth:`place`)."""

    def __init__(self) -> None:
        self.made: list[tuple[Path, Path]] = []  # (hierarchy, cgroup)
        #: what the workers got, said in the bench's output
        self.placement = "this bench is not confined: the workers run beside it"

    def _make(self) -> None:
        for hierarchy in CGROUPS:
            mine = confined_in(hierarchy)
            if mine is None:
                continue
            ours = Path(hierarchy) / mine.lstrip("/")
            theirs = ours.parent / (ours.name + SUFFIX)
            theirs.mkdir(exist_ok=True)
            self.made.append((Path(hierarchy), theirs))
            if Path(hierarchy).name == "cpuset":
                rest = cpus((Path(hierarchy) / "cpuset.cpus").read_text()) - cpus((ours / "cpuset.cpus").read_text())
                # A bench confined to every CPU leaves none apart: the workers share its CPUs.
                (theirs / "cpuset.cpus").write_text(cpu_list(rest or cpus((ours / "cpuset.cpus").read_text())))
                (theirs / "cpuset.mems").write_text((ours / "cpuset.mems").read_text())
            else:
                (theirs / "cpu.shares").write_text((ours / "cpu.shares").read_text())
        if self.made:
            self.placement = ", ".join(
                f"{p} (CPUs {(p / 'cpuset.cpus').read_text().strip()})" if (p / "cpuset.cpus").exists()
                else f"{p} (cpu.shares {(p / 'cpu.shares').read_text().strip()})" for _, p in self.made)

    def place(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the workers' cgroups."""
        if not self.made:
            self._make()
        for _, group in self.made:
            (group / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Remove the cgroups (their processes have stopped; a leftover one goes to the root first)."""
        for root, group in reversed(self.made):
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # it ended meanwhile
            group.rmdir()
        self.made = []
