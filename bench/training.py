"""What protection costs a training run (``--parts training``): step times with the tool off,
with ``ckpt up`` watching the run, and with ``ProtectCallback`` declaring every save, at the
tool's default background priority and at others.

Two profiles (``--training-profile``):

- ``target``: the issue's bar, a save of about 1 GB every 2 minutes. A GPT-2 of 81 M parameters
  built from a config (never downloaded) with its Adam state: ``checkpoint-N/`` folders of
  0.98 GB, saved every ``save_seconds`` of training (a callback asks the Trainer to save), for
  ``seconds`` of training.
- ``steps``: saves every few steps. A small GPT-2 (4 layers, width 384; 124 MB saves) saving
  every ``save_every`` steps for ``steps`` steps.

Each variant is a fresh training process (and, with the tool, a fresh ``ckpt up`` with 3
storage workers, RF 2, all on this machine). A step's time runs from one step's end to the
next, so it holds the save and the save hooks. Besides step times, each row says how many of
its saves were protected (verified) when training ended, how long the rest took after it, and
the CPU seconds the tool's processes used: a tool that defers all its work has no overhead and
protects nothing. ``off`` runs first and last: the two show this machine's noise.

    python -m bench.training PROFILE MODE RUN OUT.json ARGS...   one training process
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.system import System, cpu_seconds, descendants
from pipeline.settings import Settings
from pipeline.states import ACTIVE, PROTECTED, JobKind

MODES = ("off", "watching", "callbacks")


@dataclass(frozen=True)
class Variant:
    label: str
    mode: str  # one of MODES
    env: dict[str, str] = field(default_factory=dict)  # the tool's settings (CKPT_*), on top of its defaults
    #: The storage workers apart from the training host (bench.elsewhere): what a training
    #: host carries when its copies go to other machines, as in a deployment.
    elsewhere: bool = False


NICE0 = {"CKPT_NICE": "0", "CKPT_IONICE": "none"}
#: What each profile runs by default: the tool at its defaults, then what priority and thread caps change.
VARIANTS = {
    "target": (Variant("off", "off"), Variant("watching", "watching"), Variant("callbacks", "callbacks"),
               Variant("callbacks, nice 0", "callbacks", NICE0),
               Variant("watching, workers elsewhere", "watching", elsewhere=True),
               Variant("callbacks, workers elsewhere", "callbacks", elsewhere=True),
               Variant("off (again)", "off")),
    "steps": (Variant("off", "off"), Variant("watching", "watching"), Variant("callbacks", "callbacks"),
              Variant("watching, nice 0", "watching", NICE0), Variant("callbacks, nice 0", "callbacks", NICE0),
              Variant("callbacks, nice 19 + idle I/O", "callbacks", {"CKPT_NICE": "19", "CKPT_IONICE": "idle"}),
              Variant("callbacks, 1 hash thread, 1 worker thread", "callbacks",
                      {"CKPT_HASH_THREADS": "1", "BENCH_UP_THREADS": "1"}),
              Variant("off (again)", "off")),
}


def gpt2(profile: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if profile == "target":  # 81 M parameters: 0.98 GB with the optimizer
        return GPT2LMHeadModel(GPT2Config(vocab_size=32000, n_positions=64, n_embd=768, n_layer=8, n_head=12))
    return GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, n_embd=384, n_layer=4, n_head=6))


def train(profile: str, mode: str, run: Path, out: Path, plan: dict[str, float]) -> None:
    """One training run; writes its step intervals (seconds), saves and total to ``out``."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    timed = profile == "target"
    batch, seq = (2, 64) if timed else (8, 128)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.saves = 0
            self.last_save = self.start = time.perf_counter()

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            self.saves += 1
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            now = time.perf_counter()
            self.ends.append(now)
            if timed and now - self.last_save >= plan["save_seconds"]:
                control.should_save, self.last_save = True, now
            if timed and now - self.start >= plan["seconds"]:
                control.should_training_stop = True
            return control

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, vocab: int) -> None:
            self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = gpt2(profile)
    clock = Clock()
    callbacks: list[Any] = [clock]
    if mode == "callbacks":
        from pipeline.integrations.transformers import ProtectCallback

        callbacks.insert(0, ProtectCallback())
    max_steps = 100_000 if timed else int(plan["steps"])
    args = TrainingArguments(output_dir=str(run), per_device_train_batch_size=batch, max_steps=max_steps,
                             save_strategy="no" if timed else "steps", save_steps=int(plan.get("save_every", 500)),
                             save_total_limit=3, logging_steps=100_000, report_to=[], use_cpu=True, seed=7,
                             dataloader_num_workers=0, disable_tqdm=True)
    data = Tokens(max_steps * batch if not timed else 4096, model.config.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    recorder_cpu = 0.0
    if mode == "callbacks":  # the trainer's recorder hashes: its CPU is the tool's, not under `ckpt up`
        from pipeline import api

        api.protector().drain()  # what the interpreter's exit would wait for anyway
        recorder_cpu = sum(cpu_seconds(c.proc.pid) for c in api.protector().record._children.values())  # type: ignore[attr-defined]
    steps_s = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    saves = sorted(run.glob("checkpoint-*"))
    size = sum(f.stat().st_size for f in saves[0].rglob("*") if f.is_file()) if saves else 0
    out.write_text(json.dumps({"mode": mode, "steps": steps_s, "total_s": total, "save_bytes": size,
                               "threads": torch.get_num_threads(), "saves": clock.saves,
                               "recorder_cpu_s": recorder_cpu}))


def _run_queue_seconds(pids: list[int]) -> float:
    """Seconds the live threads of ``pids`` and their descendants waited to run (schedstat)."""
    total = 0
    for pid in {q for p in pids for q in (p, *descendants(p))}:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def _timeline(system: System) -> list[list[Any]]:
    """Every store job's transitions: checkpoint path, time (UTC), from, to, detail."""
    from sqlalchemy import select

    from pipeline.db.engine import session_scope
    from pipeline.db.models import Checkpoint, Job, JobEvent

    with session_scope(system.settings.db_url, readonly=True) as s:
        rows = s.execute(select(Checkpoint.path, JobEvent.at, JobEvent.from_state, JobEvent.to_state, JobEvent.detail)
                         .join(Job, Job.id == JobEvent.job_id).join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
                         .where(Job.kind == JobKind.STORE).order_by(JobEvent.id)).all()
    return [[path, at.isoformat(), old, new, detail] for path, at, old, new, detail in rows]


def _protected(system: System) -> dict[str, str]:
    """Each recorded checkpoint of the bench run and the state of its store."""
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--json"], env=system.env,
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"ckpt status failed: {r.stderr[-2000:]}")
    return {c["path"]: c["state"] for c in json.loads(r.stdout)["checkpoints"]}


def _run(profile: str, v: Variant, work: Path, env: dict[str, str], plan: dict[str, float],
         system: System | None = None) -> dict:
    run, out = work / "runs" / "train", work / "train.json"
    run.mkdir(parents=True, exist_ok=True)
    cpu0 = cpu_seconds(system.proc.pid) if system and system.proc else 0.0
    apart = [w.pid for w in system.workers] if system else []
    apart0 = (sum(cpu_seconds(p) for p in apart), _run_queue_seconds(apart))
    p = subprocess.run([sys.executable, "-m", "bench.training", profile, v.mode, str(run), str(out), json.dumps(plan)],
                       env={**env, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True, text=True,
                       timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"training ({v.label}) failed: {p.stderr[-3000:]}")
    doc = json.loads(out.read_text())
    doc["label"] = v.label
    doc["ckpt_lines"] = [line for line in p.stderr.splitlines() if line.startswith("ckpt:")]
    if any("degraded" in line for line in doc["ckpt_lines"]):  # its saves were not (all) the callbacks'
        doc["label"] += " [protection degraded]"
    if system is not None and system.proc is not None:
        doc["tool_cpu_s"] = cpu_seconds(system.proc.pid) - cpu0 + doc.get("recorder_cpu_s", 0.0)
        ended = time.monotonic()
        doc["ended_at"] = datetime.now(UTC).replace(tzinfo=None).isoformat()  # as the timeline's
        if apart:  # did the workers apart get the CPU they asked for (bench.elsewhere)?
            doc["workers_apart"] = {"placement": system.elsewhere.placement,
                                    "cpu_s": sum(cpu_seconds(p) for p in apart) - apart0[0],
                                    "run_queue_wait_s": _run_queue_seconds(apart) - apart0[1]}
        states = _protected(system)
        doc["protected_at_end"] = sum(s in PROTECTED for s in states.values())
        while any(s in ACTIVE[JobKind.STORE] for s in states.values()):
            if time.monotonic() - ended > 900:
                raise RuntimeError(f"({v.label}) saves still not protected 900 s after training: {states}")
            time.sleep(1)
            states = _protected(system)
        doc["recorded"] = len(states)
        doc["protected"] = sum(s in PROTECTED for s in states.values())
        doc["catch_up_s"] = time.monotonic() - ended
        doc["timeline"] = _timeline(system)  # when each save reached each state, against ended_at
    return doc


def measure_training(work: Path, *, profile: str = "steps", steps: int = 40, save_every: int = 5,
                     seconds: float = 330.0, save_seconds: float = 120.0, only: tuple[str, ...] = ()) -> dict:
    """The profile's variants (``only``: those of these labels)."""
    variants = tuple(v for v in VARIANTS[profile] if not only or v.label in only)
    plan = ({"seconds": seconds, "save_seconds": save_seconds} if profile == "target"
            else {"steps": steps, "save_every": save_every})
    out: dict[str, Any] = {"profile": profile, "plan": plan, "variants": []}
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    for i, v in enumerate(variants):
        where = work / f"training-{profile}-{i}"
        print(f"   {v.label} ...", flush=True)
        if v.mode == "off":
            out["variants"].append(_run(profile, v, where, {**base, "CKPT_HOME": str(where / "no-home")}, plan))
            continue
        # The tool at its own defaults (the bench's System ticks faster, for latency measurements).
        tool = {"CKPT_TICK_SECONDS": str(Settings.tick_seconds),
                **{k: x for k, x in v.env.items() if k.startswith("CKPT_")}}
        threads = ("--threads", v.env["BENCH_UP_THREADS"]) if "BENCH_UP_THREADS" in v.env else ()
        with System(where, up_args=threads, workers_elsewhere=v.elsewhere, **tool) as system:
            out["variants"].append(_run(profile, v, where, system.env, plan, system))
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(doc: dict) -> str:
    rows = doc["variants"]
    off = statistics.median(rows[0]["steps"])
    plan, first = doc["plan"], rows[0]
    cadence = (f"every {plan['save_seconds']:.0f} s over {plan['seconds']:.0f} s of training"
               if doc["profile"] == "target" else f"every {plan['save_every']:.0f} steps, {plan['steps']:.0f} steps")
    lines = [f"training ({doc['profile']}): GPT-2 from a config, a save of {first['save_bytes'] / 1e9:.2f} GB "
             f"{cadence}, torch threads {first['threads']}",
             f"  {'variant':<42} {'median step':>11} {'p99 step':>9} {'total':>7} {'vs off':>7} "
             f"{'tool CPU':>9} {'saves':>5} {'protected: at end':>17} {'after':>6} {'in all':>6}"]
    for m in rows:
        med = statistics.median(m["steps"])
        tool = "recorded" in m
        cpu, after = (f"{m['tool_cpu_s']:.0f}s", f"{m['catch_up_s']:.0f}s") if tool else ("-", "-")
        lines.append(f"  {m['label']:<42} {med * 1000:>9.0f}ms {_pct(m['steps'], 0.99) * 1000:>7.0f}ms "
                     f"{m['total_s']:>6.0f}s {(med / off - 1) * 100:>+6.1f}% {cpu:>9} {m['saves']:>5} "
                     f"{m.get('protected_at_end', '-'):>17} {after:>6} {m.get('protected', '-'):>6}")
        lines += _evidence(m)
    return "\n".join(lines)


def _evidence(row: dict) -> list[str]:
    """Under a row: how its workers apart fared, and when each save unprotected at the end of
    training was detected and verified (seconds against that end)."""
    out = []
    if "workers_apart" in row:
        w = row["workers_apart"]
        out.append(f"    workers apart: {w['cpu_s']:.1f} s of CPU, {w['run_queue_wait_s']:.1f} s waiting for one; "
                   f"{w['placement']}")
    if row.get("protected_at_end", 0) < row.get("recorded", 0):
        end = datetime.fromisoformat(row["ended_at"])
        for path, at, _old, new, detail in row["timeline"]:
            if new in ("detected", "verified"):
                out.append(f"    {Path(path).name} {new} at {(datetime.fromisoformat(at) - end).total_seconds():+.0f} s"
                           f" ({detail})")
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    train(a[0], a[1], Path(a[2]), Path(a[3]), json.loads(a[4]))
