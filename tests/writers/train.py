"""Training runs that are interrupted and resumed, with the trainer integrations installed.

    python -m tests.writers.train hf|lightning reference OUT      train to the end, save the weights
    python -m tests.writers.train hf|lightning part RUN           train, stop after the second save
    python -m tests.writers.train hf|lightning resume RUN OUT     resume from RUN's newest checkpoint

``part`` runs protect every checkpoint through the integration (ProtectCallback,
ProtectedModelCheckpoint) and wait until the stopping one is protected before exiting.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.writers.write import Tokens, tiny_qwen, trainer_args

MAX_STEPS, SAVE_STEPS, STOP_AT = 6, 2, 4


def hf(mode: str, run: Path, out: Path | None) -> None:
    from transformers import Trainer, TrainerCallback

    callbacks: list[Any] = []
    if mode == "part":
        from pipeline.integrations.transformers import ProtectCallback

        class StopAfter(TrainerCallback):
            def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                if state.global_step >= STOP_AT:
                    control.should_training_stop = True
                return control

        callbacks = [ProtectCallback(wait_before_delete=True), StopAfter()]
    args = trainer_args(run, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, save_total_limit=2)
    trainer = Trainer(model=tiny_qwen(3), args=args, train_dataset=Tokens(seed=3), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    if mode == "part":
        import pipeline

        pipeline.wait_protected(run / f"checkpoint-{STOP_AT}", timeout=120)
    if out is not None:
        torch.save(trainer.model.state_dict(), out)


def tiny_module() -> Any:
    """A tiny LightningModule, the same weights every time."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(5)
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))

        def training_step(self, batch: Any, _i: int) -> Any:
            return (self.net(batch[0]) - batch[0].flip(-1)).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Tiny()


def lightning(mode: str, run: Path, out: Path | None) -> None:
    import lightning as L

    g = torch.Generator().manual_seed(11)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 32, generator=g)),
                                       batch_size=8, shuffle=False)
    callbacks: list[Any] = []
    if mode == "part":
        from pipeline.integrations.lightning import ProtectedModelCheckpoint

        callbacks = [ProtectedModelCheckpoint(dirpath=str(run), filename="epoch_{epoch}", every_n_epochs=1,
                                              save_top_k=2, monitor="step", mode="max", wait_before_delete=True)]
    epochs = 3 if mode != "part" else 2  # a node lost after the second epoch's checkpoint
    trainer = L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1, deterministic=True,
                        enable_checkpointing=bool(callbacks), default_root_dir=str(run.parent / "lightning-root"))
    model = tiny_module()
    ckpt_path = None
    if mode == "resume":
        ckpt_path = str(max(run.glob("epoch_epoch=*.ckpt"), key=lambda p: p.name))
    trainer.fit(model, data, ckpt_path=ckpt_path)
    if mode == "part":
        import pipeline

        pipeline.wait_protected(run / "epoch_epoch=1.ckpt", timeout=120)
    if out is not None:
        torch.save(model.state_dict(), out)


def main(argv: list[str]) -> None:
    trainer, mode, run = argv[0], argv[1], Path(argv[2])
    out = Path(argv[3]) if len(argv) > 3 else None
    if mode == "reference":
        out, run = run, run.parent / f"{run.stem}-run"
    run.mkdir(parents=True, exist_ok=True)
    {"hf": hf, "lightning": lightning}[trainer](mode, run, out)


if __name__ == "__main__":
    main(sys.argv[1:])
