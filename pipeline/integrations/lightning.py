"""The Lightning checkpoint callback: ``pip install 'ckpt-pipeline[lightning]'``.

    from pipeline.integrations.lightning import ProtectedModelCheckpoint
    trainer = L.Trainer(callbacks=[ProtectedModelCheckpoint(dirpath="runs/a", every_n_train_steps=100,
                                                            save_top_k=2, wait_before_delete=True)])

A ``ModelCheckpoint`` (same arguments) that declares each file it saves complete, and with
``wait_before_delete`` makes its ``save_top_k`` deletions wait until the file is protected.
``dirpath`` must be a run under a watched root; the home is found as the ``ckpt`` commands
find it, and the callback says so at fit start (or says once why it cannot protect).
"""
from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError as exc:  # pragma: no cover - the error says what to install
    raise ImportError("pipeline.integrations.lightning needs lightning: "
                      "pip install 'ckpt-pipeline[lightning]'") from exc

from pipeline.integrations.protection import TrainerProtection
from pipeline.settings import Settings


class ProtectedModelCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that declares each file it saves complete, never raising into
    training (pipeline.integrations.protection), and with ``wait_before_delete`` makes its
    ``save_top_k`` deletions wait until the file is protected (unless protection is degraded)."""

    def __init__(self, *args: Any, wait_before_delete: bool = False, protect_timeout: float = 3600.0,
                 ckpt_settings: Settings | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_before_delete, self.protect_timeout, self.ckpt_settings = (
            wait_before_delete, protect_timeout, ckpt_settings)
        self.protection = TrainerProtection(ckpt_settings)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath and "://" not in str(self.dirpath):
            os.makedirs(self.dirpath, exist_ok=True)  # what the first save does; a run must exist to be one
            self.protection.start(str(self.dirpath))

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero and os.path.isfile(filepath) and not os.path.islink(filepath):
            self.protection.start(os.path.dirname(filepath))
            self.protection.saved(filepath)

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        if self.wait_before_delete and trainer.is_global_zero and os.path.isfile(filepath):
            self.protection.before_delete(filepath, self.protect_timeout)
        super()._remove_checkpoint(trainer, filepath)
