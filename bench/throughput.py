"""Checkpoints per second to protected, with keep-last rotation on: ``--parts throughput``.

The real system (``ckpt up``: 3 storage workers on loopback, RF 2) watches one run while this
process writes ``--throughput-saves`` (default 1,000) safetensors files of 1 MiB into it as fast
as it can, each renamed into place as a trainer does, with ``CKPT_KEEP_LAST=3``: every protected
save beyond the newest 3 is rotated (its local copy deleted) while the next ones arrive. The
rate is saves over the time from the first write until every save is protected (verified, or
rotated after it was), printed per slice of the saves so a rate that sinks as the catalog grows
shows.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from bench import layouts
from bench.system import System


def measure_throughput(work: Path, saves: int = 1000, keep_last: int = 3, timeout: float = 1800.0) -> dict:
    import torch
    from sqlalchemy import func, select

    from pipeline import states
    from pipeline.db.engine import session_scope
    from pipeline.db.models import Checkpoint, Job

    out: dict = {"saves": saves, "keep_last": keep_last, "mib_each": 1}
    with System(work / "sys-throughput", CKPT_KEEP_LAST=str(keep_last)) as system:
        run = system.runs / "many"
        run.mkdir()
        protected_at: dict[int, float] = {}

        def protected() -> int:
            with session_scope(system.settings.db_url, readonly=True) as s:
                return s.scalar(select(func.count(Job.id)).join(Checkpoint, Job.checkpoint_id == Checkpoint.id)
                                .where(Checkpoint.run == str(run), Job.kind == "store",
                                       Job.state.in_(sorted(states.PROTECTED)))) or 0

        cpu0, own0 = system.cpu_by_role(), _own_cpu()
        t0 = time.perf_counter()
        for i in range(saves):
            w = torch.randint(-2**31, 2**31 - 1, (1 << 18,), dtype=torch.int32,
                              generator=torch.Generator().manual_seed(5000 + i))
            layouts.write_file({"w": w}, run / f"c_{i:05d}.safetensors")
            if i % 50 == 49:
                protected_at.setdefault(protected(), time.perf_counter() - t0)
        out["written_s"] = time.perf_counter() - t0
        n = 0
        while n < saves and time.perf_counter() - t0 < timeout:
            n = protected()
            protected_at.setdefault(n, time.perf_counter() - t0)
            time.sleep(0.2)
        out["seconds"] = time.perf_counter() - t0
        cpu1 = system.cpu_by_role()
        out["cpu_s"] = {role: round(cpu1[role] - cpu0.get(role, 0.0), 2) for role in cpu1}
        out["cpu_s"]["bench (writing)"] = round(_own_cpu() - own0, 2)
        out["load"] = os.getloadavg()
        out["stages"] = _stages(system, str(run))
        out["protected"] = n
        out["per_s"] = n / out["seconds"] if n == saves else None
        with session_scope(system.settings.db_url, readonly=True) as s:
            out["by_state"] = dict(s.execute(select(Job.state, func.count(Job.id)).where(Job.kind == "store")
                                             .group_by(Job.state)).all())
            out["on_disk"] = sum(1 for _ in run.glob("*.safetensors"))
        out["timeline"] = sorted(protected_at.items())
    return out


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _stages(system: System, run: str) -> dict[str, float]:
    """Medians over the saves: from written (its file's time) to detected (its store job
    created), and from detected to protected."""
    from sqlalchemy import func, select

    from pipeline import states
    from pipeline.db.engine import session_scope
    from pipeline.db.models import Checkpoint, Job, JobEvent

    with session_scope(system.settings.db_url, readonly=True) as s:
        rows = s.execute(select(Checkpoint.mtime, Job.created_at, func.min(JobEvent.at))
                         .join(Job, Job.checkpoint_id == Checkpoint.id)
                         .join(JobEvent, JobEvent.job_id == Job.id)
                         .where(Checkpoint.run == run, Job.kind == "store",
                                JobEvent.to_state.in_(sorted(states.PROTECTED)))
                         .group_by(Job.id)).all()
    if not rows:
        return {}
    waits = sorted(created.timestamp() - written for written, created, _ in rows)
    after = [(at - created).total_seconds() for _, created, at in rows]
    return {"written_to_detected_median_s": round(statistics.median(waits), 2),
            "written_to_detected_p90_s": round(waits[int(0.9 * (len(waits) - 1))], 2),
            "detected_to_protected_median_s": round(statistics.median(after), 2)}


def table(t: dict) -> str:
    head = (f"throughput: {t['saves']:,} saves of {t['mib_each']} MiB written in {t['written_s']:.1f} s, "
            f"keep-last {t['keep_last']} rotation on")
    rate = (f"{t['saves']:,} protected in {t['seconds']:.1f} s = {t['per_s']:.1f} checkpoints/s   target >= 10"
            if t["per_s"] else f"only {t['protected']:,} of {t['saves']:,} protected in {t['seconds']:.0f} s")
    lines = [head, f"  {rate}", f"  store jobs by state: {t['by_state']}; saves left on disk: {t['on_disk']}",
             f"  stages (median): {t.get('stages')}; load average {t.get('load')}",
             "  CPU seconds by process: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                      sorted(t.get("cpu_s", {}).items(), key=lambda kv: -kv[1])),
             "  protected so far    at s    rate in the slice /s"]
    prev_n, prev_t = 0, 0.0
    step = max(1, t["saves"] // 5)
    for n, at in t["timeline"]:
        if n >= prev_n + step or (n == t["protected"] and n > prev_n):
            lines.append(f"  {n:>15,} {at:>9.1f} {(n - prev_n) / max(at - prev_t, 1e-9):>14.1f}")
            prev_n, prev_t = n, at
    return "\n".join(lines)
