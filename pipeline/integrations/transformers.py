"""The HF Trainer callback: ``pip install 'ckpt-pipeline[transformers]'``.

    from pipeline.integrations.transformers import ProtectCallback
    trainer = Trainer(..., callbacks=[ProtectCallback(wait_before_delete=True)])

The Trainer's ``output_dir`` must be a run under a watched root (``ckpt up --root``); the
callback finds the home as the ``ckpt`` commands do (``CKPT_HOME``, a ``.ckpt`` upward, the
user's default) and says so at train start, or says once why it cannot protect.
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

from pipeline.integrations.protection import TrainerProtection
from pipeline.settings import Settings

log = logging.getLogger("ckpt.integrations")


class ProtectCallback(TrainerCallback):
    """Declares every ``checkpoint-N/`` the Trainer saves complete, at once.

    It never raises into training and never makes a save wait for hashing or the control
    plane: the declaration is recorded in the background (pipeline.protector), and a
    failure is logged once, with its cause, and shown as "protection degraded" by
    ``ckpt status``. At train start it says through which home and roots it protects.
    With ``wait_before_delete``, ``on_save`` waits (up to ``timeout`` s) until every
    checkpoint that the Trainer's next ``save_total_limit`` rotation may delete is
    protected, so the Trainer never deletes a checkpoint that exists nowhere else (unless
    protection is degraded: then it does not wait).
    """

    def __init__(self, *, wait_before_delete: bool = False, timeout: float = 3600.0,
                 settings: Settings | None = None) -> None:
        self.wait_before_delete, self.timeout, self.settings = wait_before_delete, timeout, settings
        self.protection = TrainerProtection(settings)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> TrainerControl:
        if state.is_world_process_zero:
            self.protection.start(str(args.output_dir))
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> TrainerControl:
        if not state.is_world_process_zero:
            return control
        output_dir = str(args.output_dir)
        self.protection.start(output_dir)  # a Trainer that saves without training first
        self.protection.saved(os.path.join(output_dir, f"checkpoint-{state.global_step}"))
        limit = args.save_total_limit
        if self.wait_before_delete and limit:
            try:
                older = at_risk(output_dir, limit, state.best_model_checkpoint)
            except OSError as exc:
                log.warning("ckpt: cannot list %s to wait for its older checkpoints: %s", output_dir, exc)
                older = []
            for path in older:
                self.protection.before_delete(path, self.timeout)
        return control


def at_risk(output_dir: str, save_total_limit: int, best: str | None = None) -> list[str]:
    """The checkpoints the Trainer's next save may delete.

    The Trainer rotates inside ``_save_checkpoint``, after writing the next checkpoint and
    before ``on_save`` (``transformers.trainer_utils.rotate_checkpoints``): of the folders
    ``checkpoint-*`` there then, sorted by modification time (or by the step in the name when
    the times are too close), path breaking ties, it keeps the newest and the best model's
    (``best``, the state's ``best_model_checkpoint``) and deletes the others oldest first until
    ``save_total_limit`` are left. So the newest now (this save's) is at risk too when the best
    is kept beside the next one. Which is the best after the next evaluation (this one, or the
    next checkpoint) and which order the Trainer sorts by are not known yet: every case counts.
    """
    folders = [os.path.join(output_dir, n) for n in os.listdir(output_dir)
               if n.startswith("checkpoint-") and os.path.isdir(os.path.join(output_dir, n))]
    by_time = [p for _t, p in sorted((os.path.getmtime(p), p) for p in folders)]
    stepped = [(m, p) for p in folders if (m := _STEP_IN_PATH.match(p)) is not None]
    by_step = [p for _s, p in sorted((int(m.group(1)), p) for m, p in stepped)]
    best_path = os.path.join(output_dir, os.path.basename(os.path.normpath(best))) if best else None
    nxt = object()  # the checkpoint the next save writes
    risky: set[object] = set()
    for order in (by_time, by_step):
        ordered: list[object] = [*order, nxt]
        for best_then in {best_path, None}:  # the best now, or the next checkpoint (it keeps nothing else)
            kept = {nxt} if best_then is None else {nxt, best_then}
            left = len(ordered)
            for p in ordered:
                if left <= max(save_total_limit, len(kept)):
                    break
                if p not in kept:
                    risky.add(p)
                    left -= 1
    return sorted(p for p in folders if p in risky)


#: How the Trainer reads a step from a checkpoint's path (transformers.trainer_utils.sort_checkpoints).
_STEP_IN_PATH = re.compile(r".*checkpoint-([0-9]+)")
