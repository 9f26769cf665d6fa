"""A training run protected through its integration, whatever happens to the tool meanwhile.

    python -m tests.writers.protected hf|lightning RUN [GATE]

Trains ``STEPS`` steps with a save every ``EVERY`` (the HF Trainer with ``ProtectCallback``, or
Lightning with ``ProtectedModelCheckpoint``, both with ``wait_before_delete``) and prints one
JSON line at the end: ``{"steps": N, "saves": [...]}``. With ``GATE`` (a directory), after the
first save is protected it writes ``GATE/saved`` and waits for ``GATE/go``: the test does
something to the tool (kills ``ckpt up``) between the first save and the rest. With
``CKPT_TEST_WAIT_LAST=1`` it waits until the last save is protected before exiting.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.writers.train import tiny_module
from tests.writers.write import Tokens, tiny_qwen, trainer_args

STEPS, EVERY = 8, 2


def gate_after_first(path: Path, gate: Path | None) -> None:
    if gate is None or (gate / "saved").exists():
        return
    import pipeline

    pipeline.wait_protected(path, timeout=120)
    (gate / "saved").write_text(str(path))
    deadline = time.monotonic() + 120
    while not (gate / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit("the test never said go")
        time.sleep(0.05)


def hf(run: Path, gate: Path | None) -> tuple[int, list[str]]:
    from transformers import Trainer, TrainerCallback

    from pipeline.integrations.transformers import ProtectCallback

    class Gate(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            gate_after_first(run / f"checkpoint-{state.global_step}", gate)
            return control

    args = trainer_args(run, max_steps=STEPS, save_steps=EVERY, save_total_limit=2)
    trainer = Trainer(model=tiny_qwen(3), args=args, train_dataset=Tokens(seed=3),
                      callbacks=[ProtectCallback(wait_before_delete=True, timeout=120), Gate()])
    trainer.train()
    return trainer.state.global_step, [str(run / f"checkpoint-{s}") for s in range(EVERY, STEPS + 1, EVERY)]


def lightning(run: Path, gate: Path | None) -> tuple[int, list[str]]:
    import lightning as L

    from pipeline.integrations.lightning import ProtectedModelCheckpoint

    class Gated(ProtectedModelCheckpoint):
        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            super()._save_checkpoint(trainer, filepath)
            gate_after_first(Path(filepath), gate)

    g = torch.Generator().manual_seed(11)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g)),
                                       batch_size=4, shuffle=False)
    ckpt = Gated(dirpath=str(run), filename="step_{step}", every_n_train_steps=EVERY, save_top_k=2,
                 monitor="step", mode="max", wait_before_delete=True, protect_timeout=120)
    trainer = L.Trainer(max_steps=STEPS, callbacks=[ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        default_root_dir=str(run.parent / "lightning-root"))
    trainer.fit(tiny_module(), data)
    return trainer.global_step, [str(run / f"step_step={s}.ckpt") for s in range(EVERY, STEPS + 1, EVERY)]


def main(argv: list[str]) -> None:
    run = Path(argv[1])
    gate = Path(argv[2]) if len(argv) > 2 else None
    steps, saves = {"hf": hf, "lightning": lightning}[argv[0]](run, gate)
    if os.environ.get("CKPT_TEST_WAIT_LAST") == "1":
        import pipeline

        pipeline.wait_protected(saves[-1], timeout=120)
    print(json.dumps({"steps": steps, "saves": saves}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
