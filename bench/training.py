"""What protection costs a training run (``--parts training``): step times with the tool off,
with ``ckpt up`` watching the run, and with ``ProtectCallback`` declaring every save.

A small GPT-2 built from a config (never downloaded) is trained on this machine's CPU by the
HF Trainer, saving every ``save_every`` steps (model, optimizer: ``checkpoint-N/`` folders of
about 125 MB), each mode in a fresh training process (and, for the two modes with the tool, a
fresh ``ckpt up`` with 3 storage workers, RF 2). A step's time runs from one step's end to
the next, so it holds the save and the save hooks. The table gives the median and p99 step
time and the total, and each mode's median against the tool being off.

    python -m bench.training MODE RUN OUT.json     one training process (what measure runs)
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.system import System

MODES = ("off", "watching", "callbacks")


def tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=128, n_embd=384, n_layer=4, n_head=6))


def train(mode: str, run: Path, out: Path, steps: int, save_every: int) -> None:
    """One training run; writes its step intervals (seconds) and total to ``out``."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            self.ends.append(time.perf_counter())
            return control

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 8192, (steps * 8, 128), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    clock = Clock()
    callbacks: list[Any] = [clock]
    if mode == "callbacks":
        from pipeline.integrations.transformers import ProtectCallback

        callbacks.insert(0, ProtectCallback())
    args = TrainingArguments(output_dir=str(run), per_device_train_batch_size=8, max_steps=steps,
                             save_steps=save_every, save_total_limit=3, logging_steps=10_000, report_to=[],
                             use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    steps_s = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    size = sum(f.stat().st_size for f in next(run.glob("checkpoint-*")).rglob("*") if f.is_file())
    out.write_text(json.dumps({"mode": mode, "steps": steps_s, "total_s": total, "save_bytes": size,
                               "threads": torch.get_num_threads()}))


def _run(mode: str, work: Path, env: dict[str, str], steps: int, save_every: int) -> dict:
    run, out = work / "runs" / mode, work / f"{mode}.json"
    run.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "bench.training", mode, str(run), str(out), str(steps),
                        str(save_every)], env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
                       capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"training ({mode}) failed: {p.stderr[-3000:]}")
    doc = json.loads(out.read_text())
    doc["ckpt_lines"] = [line for line in p.stderr.splitlines() if line.startswith("ckpt:")]
    return doc


def measure_training(work: Path, *, steps: int = 40, save_every: int = 5) -> dict:
    out: dict[str, Any] = {"steps": steps, "save_every": save_every, "modes": {}}
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    out["modes"]["off"] = _run("off", work / "off", {**base, "CKPT_HOME": str(work / "no-home")}, steps, save_every)
    for mode in MODES[1:]:
        with System(work / mode) as system:
            out["modes"][mode] = _run(mode, work / mode, system.env, steps, save_every)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(doc: dict) -> str:
    off = statistics.median(doc["modes"]["off"]["steps"])
    some = doc["modes"]["off"]
    lines = [f"training: GPT-2 from a config, {doc['steps']} steps, a save of {some['save_bytes'] / 1e6:.0f} MB every "
             f"{doc['save_every']} steps, torch threads {some['threads']}",
             f"  {'mode':<11} {'median step':>12} {'p99 step':>10} {'total':>9} {'median vs off':>14}"]
    for mode in MODES:
        m = doc["modes"][mode]
        med = statistics.median(m["steps"])
        lines.append(f"  {mode:<11} {med * 1000:>10.0f}ms {_pct(m['steps'], 0.99) * 1000:>8.0f}ms "
                     f"{m['total_s']:>8.1f}s {(med / off - 1) * 100:>+13.1f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    a = sys.argv[1:]
    train(a[0], Path(a[1]), Path(a[2]), int(a[3]), int(a[4]))
