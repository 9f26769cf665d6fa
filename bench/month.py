""""A month of training": what the storage workers hold with and without a retention policy.

A run saves an HF Trainer folder (``checkpoint-N/``: a safetensors file and the
``trainer_state.json`` with its ``eval_loss``) every 29 minutes of simulated time for a month
(1,500 saves); each save changes a fraction of the tensors of the one before, so steps share
most of their content. The real system protects each one (``ckpt up``, 3 storage workers,
RF 2), the remote policy (keep-last 5 + daily 7 + best 3 by eval_loss) forgets the rest, and a
collection (``ckpt gc --wait``) runs every simulated day.

Measured, against simulated time: the bytes on the workers' disks (with the policy), and
what they would hold without one: RF x every distinct content ever stored (nothing but
superseded versions is ever deleted without a policy, and a run's saves supersede nothing).
And the collector's throughput, from its jobs.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
from safetensors.torch import save_file
from sqlalchemy import func, select

from bench.system import System
from pipeline.db.engine import session_scope
from pipeline.db.models import Content, Job

T0 = datetime(2026, 10, 1, tzinfo=UTC)
POLICY = {"CKPT_REMOTE_KEEP_LAST": "5", "CKPT_REMOTE_KEEP_DAILY": "7", "CKPT_REMOTE_KEEP_BEST": "3",
          "CKPT_REMOTE_BEST_METRIC": "eval_loss", "CKPT_REMOTE_BEST_MODE": "min"}


def tensors(step: int, n: int, size: int, changed: float, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model at ``step``: ``changed`` of its ``n`` tensors retrained since the step before."""
    rnd = random.Random(step)
    for i in rnd.sample(range(n), max(1, int(n * changed))):
        g = torch.Generator().manual_seed(step * 1000 + i)
        base[f"layer.{i:03d}.weight"] = torch.randn(size // 4, generator=g)
    return dict(base)


def save(run: Path, step: int, sd: dict[str, torch.Tensor], loss: float, at: datetime) -> Path:
    """An HF Trainer folder, trainer_state.json last, renamed into place, dated ``at``."""
    tmp = run / f".checkpoint-{step}.tmp"
    tmp.mkdir()
    save_file(sd, str(tmp / "model.safetensors"))
    state = {"global_step": step, "best_metric": None,
             "log_history": [{"step": step, "loss": loss * 1.1, "epoch": step / 1000},
                             {"step": step, "eval_loss": loss, "epoch": step / 1000}]}
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    stamp = at.timestamp()
    for p in tmp.iterdir():
        os.utime(p, (stamp, stamp))
    path = run / f"checkpoint-{step}"
    os.rename(tmp, path)
    return path


def disk_bytes(system: System) -> int:
    """Bytes of the shard files on the workers' disks (what they really hold)."""
    return sum(p.stat().st_size for w in (system.home / "workers").iterdir()
               for p in (w / "shards").rglob("*") if p.is_file())


def measure_month(work: Path, saves: int = 1500, every: timedelta = timedelta(minutes=29), n_tensors: int = 32,
                  tensor_bytes: int = 64 * 1024, changed: float = 0.1, backlog: int = 24) -> dict:
    env = {**POLICY, "CKPT_GC_GRACE_SECONDS": "0", "CKPT_GC_CRON": "", "CKPT_KEEP_LAST": "2",
           "CKPT_SHARD_SIZE": str(256 * 1024), "CKPT_GC_RATE": "0"}
    out: dict = {"saves": saves, "every_min": every.total_seconds() / 60, "checkpoint_bytes": n_tensors * tensor_bytes,
                 "changed": changed, "policy": "keep-last 5 + daily 7 + best 3 by eval_loss", "points": [],
                 "collections": []}
    base: dict[str, torch.Tensor] = {}
    tensors(0, n_tensors, tensor_bytes, 1.0, base)
    day = int(timedelta(days=1) / every)
    started = time.monotonic()
    with System(work / "sys-month", **env) as system:
        run = system.runs / "llm"
        run.mkdir()
        rf = system.settings.rf
        for i in range(1, saves + 1):
            at = T0 + i * every
            loss = 2.0 * math.exp(-i / 600) + 0.3 + random.Random(i).gauss(0, 0.03)
            save(run, i * 100, tensors(i, n_tensors, tensor_bytes, changed, base), loss, at)
            _wait_protected(system, i - backlog)
            if i % 12 == 0 or i == saves:
                _wait_protected(system, i)
                out["points"].append(_point(system, i, at, rf))
            if i % day == 0 or i == saves:
                _wait_protected(system, i)
                time.sleep(2 * float(system.settings.tick_seconds) * 10)  # the policy sweep runs every 10 ticks
                t = time.monotonic()
                _seconds, _rss, text = system.cli("gc", "--wait")
                out["collections"].append(_collection(system, time.monotonic() - t, text))
                out["points"].append(_point(system, i, at, rf))
        out["wall_s"] = time.monotonic() - started
    last = out["points"][-1]
    out["final_with_policy"], out["final_without_policy"] = last["disk_bytes"], last["without_policy_bytes"]
    deleted = sum(c["copies"] for c in out["collections"])
    seconds = sum(c["seconds"] for c in out["collections"] if c["copies"])
    out["collector_copies_per_s"] = deleted / seconds if seconds else None
    out["collector_mb_per_s"] = sum(c["bytes"] for c in out["collections"]) / seconds / 1e6 if seconds else None
    return out


def _wait_protected(system: System, upto: int, timeout: float = 600) -> None:
    """Until the first ``upto`` saves are protected (or forgotten after being protected)."""
    if upto <= 0:
        return
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(system.settings.db_url, readonly=True) as s:
            n = s.scalar(select(func.count(Job.id)).where(
                Job.kind == "store", Job.state.in_(("verified", "rotated", "forgotten")))) or 0
        if n >= upto:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {n} of {upto} saves protected after {timeout:.0f} s")
        time.sleep(0.1)


def _point(system: System, i: int, at: datetime, rf: int) -> dict:
    with session_scope(system.settings.db_url, readonly=True) as s:
        ever = s.scalar(select(func.coalesce(func.sum(Content.size), 0))) or 0
        kept = s.scalar(select(func.count(Job.id)).where(Job.kind == "store",
                                                         Job.state.in_(("verified", "rotated")))) or 0
    return {"save": i, "at": at.isoformat(), "days": (at - T0).total_seconds() / 86400,
            "disk_bytes": disk_bytes(system), "without_policy_bytes": rf * int(ever), "kept": kept}


def _collection(system: System, seconds: float, text: str) -> dict:
    """One `ckpt gc --wait`: its jobs (named in its output), what they deleted, how long it took."""
    ids = [int(m) for m in re.findall(r"collection job (\d+)", text)]
    with session_scope(system.settings.db_url, readonly=True) as s:
        jobs = s.scalars(select(Job).where(Job.id.in_(ids))).all()
    return {"seconds": seconds, "jobs": len(jobs), "copies": sum(j.params.get("deleted", 0) for j in jobs),
            "bytes": sum(j.params.get("bytes", 0) for j in jobs)}


def plot(month: dict, path: Path) -> Path:
    """The chart: bytes on the workers against simulated days, with and without the policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = [p["days"] for p in month["points"]]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(days, [p["without_policy_bytes"] / 1e9 for p in month["points"]],
            label="without a policy (RF x all content)")
    ax.plot(days, [p["disk_bytes"] / 1e9 for p in month["points"]], label=f"with {month['policy']}")
    ax.set_xlabel("days of training (a save every 29 min)")
    ax.set_ylabel("GB on the storage workers")
    ax.set_title(f"A month of training: {month['saves']} saves of {month['checkpoint_bytes'] / 2**20:.0f} MiB, "
                 f"{month['changed']:.0%} of tensors changed per save")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def table(month: dict) -> str:
    return "\n".join([
        f"month of training: {month['saves']} saves, policy {month['policy']}, {month['wall_s']:.0f} s wall",
        f"  bytes on the workers at the end: {month['final_with_policy'] / 1e9:,.3f} GB with the policy, "
        f"{month['final_without_policy'] / 1e9:,.3f} GB without "
        f"({month['final_without_policy'] / max(1, month['final_with_policy']):.0f}x)",
        f"  collector: {sum(c['copies'] for c in month['collections'])} copies deleted in "
        f"{len(month['collections'])} collections, {month['collector_copies_per_s'] or 0:,.0f} copies/s, "
        f"{month['collector_mb_per_s'] or 0:,.0f} MB/s (unthrottled)",
    ])
