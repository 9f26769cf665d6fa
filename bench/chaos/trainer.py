"""A training host's trainer for the chaos soak: saves a real model in a loop.

``python -m bench.chaos.trainer --runs DIR --ledger FILE ...`` builds a small Llama model from a
config (nothing downloaded) sized to ``--mb``, then, every ``--every`` seconds (drawn from the
range), changes a few of its layers (a training step) and saves it: either one safetensors file
(``step_N.safetensors``, written under a temporary name and renamed, as most trainers do) into
run ``sft``, or an HF Trainer folder (``checkpoint-N/``, written in place by ``save_pretrained``,
then ``trainer_state.json`` last, as the Trainer does) into run ``hf``. Once a save is complete
on disk, one JSON line goes to the ledger: its path, the SHA-256 of each file (read back from the
disk) and its size. The soak's checks trust the ledger, never the control plane, for what was
saved.

It stops between saves once the file ``--stop`` exists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from pathlib import Path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def build_model(mb: float, seed: int):
    """A bf16 Llama of about ``mb`` MB: the layer count fills what the embeddings leave."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    hidden = 128 if mb < 40 else 512
    vocab = 2048 if mb < 40 else 8192
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * (hidden * 8 // 3) + 2 * hidden)
    layers = max(2, int((mb * 1e6 - 2 * 2 * vocab * hidden) // per_layer))
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                         vocab_size=vocab, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def train_step(model, rng: random.Random, layers: int = 2) -> None:
    """Change ``layers`` random decoder layers (the rest keep their bytes, as in a fine-tune
    where few blocks move between saves; their shards are not sent again)."""
    import torch

    blocks = list(model.model.layers)
    with torch.no_grad():
        for block in rng.sample(blocks, min(layers, len(blocks))):
            for p in block.parameters():
                p.add_(torch.randn_like(p) * 0.01)


def next_step(runs: Path, ledger: Path) -> int:
    """One past the highest step saved before (a restarted trainer goes on, never reuses a name)."""
    steps = [0]
    if ledger.exists():
        steps += [json.loads(line)["step"] for line in ledger.read_text().splitlines() if line.strip()]
    for run in runs.iterdir() if runs.exists() else ():
        for entry in run.iterdir():
            digits = "".join(ch for ch in entry.name if ch.isdigit())
            if digits:
                steps.append(int(digits))
    return max(steps) + 1


def save(model, runs: Path, step: int, rng: random.Random, mb: float) -> tuple[Path, dict[str, str]]:
    if rng.random() < 0.5:
        from safetensors.torch import save_file

        dest = runs / "sft" / f"step_{step}.safetensors"
        tmp = dest.with_name(dest.name + ".tmp")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp), metadata={"format": "pt"})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.rename(tmp, dest)
        return dest, {"": sha256_of(dest)}
    # The HF Trainer's checkpoint-N/: the model's folder, then trainer_state.json last.
    dest = runs / "hf" / f"checkpoint-{step}"
    model.save_pretrained(dest, max_shard_size=f"{max(1, int(mb // 3))}MB")
    (dest / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return dest, {str(p.relative_to(dest)): sha256_of(p) for p in sorted(dest.rglob("*")) if p.is_file()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos.trainer")
    ap.add_argument("--host", required=True)
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--ledger", type=Path, required=True)
    ap.add_argument("--stop", type=Path, required=True)
    ap.add_argument("--mb", type=float, required=True)
    ap.add_argument("--every", type=float, nargs=2, required=True, metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for run in ("sft", "hf"):
        (a.runs / run).mkdir(parents=True, exist_ok=True)
    step = next_step(a.runs, a.ledger)
    rng = random.Random(a.seed * 1000 + step)
    model = build_model(a.mb, a.seed)
    print(f"trainer {a.host}: {sum(p.numel() for p in model.parameters()) * 2 / 1e6:.0f} MB model, from step {step}",
          flush=True)
    while not a.stop.exists():
        train_step(model, rng)
        path, files = save(model, a.runs, step, rng, a.mb)
        size = sum((path / rel if rel else path).stat().st_size for rel in files)
        line = json.dumps({"host": a.host, "step": step, "path": str(path), "files": files, "bytes": size,
                           "at": time.time()})
        with open(a.ledger, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"trainer {a.host}: saved {path.name} ({size / 1e6:.1f} MB)", flush=True)
        step += 1
        deadline = time.monotonic() + rng.uniform(*a.every)
        while time.monotonic() < deadline and not a.stop.exists():
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
