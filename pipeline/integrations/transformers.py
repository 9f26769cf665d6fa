"""The HF Trainer callback: ``pip install 'ckpt-pipeline[transformers]'``.

    from pipeline.integrations.transformers import ProtectCallback
    trainer = Trainer(..., callbacks=[ProtectCallback(wait_before_delete=True)])

The Trainer's ``output_dir`` must be a run under a watched root (``ckpt up --root``).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - the error says what to install
    raise ImportError("pipeline.integrations.transformers needs transformers: "
                      "pip install 'ckpt-pipeline[transformers]'") from exc

from pipeline import api
from pipeline.errors import CkptError
from pipeline.settings import Settings

log = logging.getLogger("ckpt.integrations")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class ProtectCallback(TrainerCallback):
    """Declares every ``checkpoint-N/`` the Trainer saves complete, at once.

    With ``wait_before_delete``, ``on_save`` waits (up to ``timeout`` s) until every checkpoint
    that the Trainer's next ``save_total_limit`` rotation may delete is protected, so the
    Trainer never deletes a checkpoint that exists nowhere else.
    """

    def __init__(self, *, wait_before_delete: bool = False, timeout: float = 3600.0,
                 settings: Settings | None = None) -> None:
        self.wait_before_delete, self.timeout, self.settings = wait_before_delete, timeout, settings

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> TrainerControl:
        if not state.is_world_process_zero:
            return control
        output_dir = str(args.output_dir)
        path = os.path.join(output_dir, f"checkpoint-{state.global_step}")
        protected = api.protect(path, settings=self.settings)
        log.info("checkpoint-%d declared complete (checkpoint %d)", state.global_step, protected.id)
        limit = args.save_total_limit
        if self.wait_before_delete and limit:
            for older in at_risk(output_dir, limit):
                try:
                    api.wait_protected(older, timeout=self.timeout, settings=self.settings)
                except CkptError as exc:
                    log.error("%s may be deleted by the Trainer before it is protected: %s", older, exc)
        return control


def at_risk(output_dir: str, save_total_limit: int) -> list[str]:
    """The checkpoints the Trainer's next save may delete: all but the newest ``limit - 1``."""
    found = []
    for name in os.listdir(output_dir):
        m = _CHECKPOINT.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    found.sort()
    keep = max(save_total_limit - 1, 0)
    return [p for _step, p in (found[:-keep] if keep else found)]
