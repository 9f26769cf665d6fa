"""The Lightning checkpoint callback: ``pip install 'ckpt-pipeline[lightning]'``.

    from pipeline.integrations.lightning import ProtectedModelCheckpoint
    trainer = L.Trainer(callbacks=[ProtectedModelCheckpoint(dirpath="runs/a", every_n_train_steps=100,
                                                            save_top_k=2, wait_before_delete=True)])

A ``ModelCheckpoint`` (same arguments) that declares each file it saves complete, and with
``wait_before_delete`` makes its ``save_top_k`` deletions wait until the file is protected.
``dirpath`` must be a run under a watched root.
"""
from __future__ import annotations

import logging
import os
from typing import Any

try:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError as exc:  # pragma: no cover - the error says what to install
    raise ImportError("pipeline.integrations.lightning needs lightning: "
                      "pip install 'ckpt-pipeline[lightning]'") from exc

from pipeline import api
from pipeline.errors import CkptError
from pipeline.settings import Settings

log = logging.getLogger("ckpt.integrations")


class ProtectedModelCheckpoint(ModelCheckpoint):
    def __init__(self, *args: Any, wait_before_delete: bool = False, protect_timeout: float = 3600.0,
                 ckpt_settings: Settings | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_before_delete, self.protect_timeout, self.ckpt_settings = (
            wait_before_delete, protect_timeout, ckpt_settings)

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero and os.path.isfile(filepath) and not os.path.islink(filepath):
            protected = api.protect(filepath, settings=self.ckpt_settings)
            log.info("%s declared complete (checkpoint %d)", filepath, protected.id)

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        if self.wait_before_delete and trainer.is_global_zero and os.path.isfile(filepath):
            try:
                api.wait_protected(filepath, timeout=self.protect_timeout, settings=self.ckpt_settings)
            except CkptError as exc:
                log.error("deleting %s, which is not protected: %s", filepath, exc)
        super()._remove_checkpoint(trainer, filepath)
