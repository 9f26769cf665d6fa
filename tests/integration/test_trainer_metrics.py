"""The best-K rule of the remote policy reads the metrics that the real HF Trainer writes.

A tiny model (built from a config) is trained with evaluation and a save every 2 steps and
``metric_for_best_model="eval_loss"``. Each ``checkpoint-N/`` folder's metrics, read as
detection reads them, must be that step's eval_loss as the Trainer logged it, and the best-1
rule must keep the checkpoint the Trainer itself calls best.
"""
from __future__ import annotations

import os
from datetime import UTC, datetime

import pytest

from pipeline.core.retention import Policy, Protected, kept
from pipeline.detection import metrics
from tests.writers.write import Tokens, tiny_qwen, trainer_args

pytestmark = pytest.mark.integration


def files_of(folder):
    return [(str(p.relative_to(folder)), str(p), p.stat().st_size) for p in folder.rglob("*") if p.is_file()]


def test_best_k_keeps_the_checkpoint_the_trainer_calls_best(tmp_path):
    from transformers import Trainer

    run = tmp_path / "run"
    args = trainer_args(run, max_steps=8, save_steps=2, eval_strategy="steps", eval_steps=2,
                        metric_for_best_model="eval_loss", greater_is_better=False, learning_rate=5e-3)
    trainer = Trainer(model=tiny_qwen(4), args=args, train_dataset=Tokens(seed=1), eval_dataset=Tokens(n=16, seed=2))
    trainer.train()
    logged = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert sorted(logged) == [2, 4, 6, 8]

    items = []
    for step in (2, 4, 6, 8):
        folder = run / f"checkpoint-{step}"
        read = metrics.read(files_of(folder))
        assert read["eval_loss"] == pytest.approx(logged[step]), (step, read)
        items.append(Protected(id=step, step=step, saved_at=datetime.fromtimestamp(os.stat(folder).st_mtime, UTC),
                               metrics=read))
    best_by_trainer = int(os.path.basename(trainer.state.best_model_checkpoint).split("-")[1])
    assert best_by_trainer != 8, "the seeds must make an older checkpoint the best, or best-1 proves nothing"
    # keep-last 1 (the newest is always kept) + best 1: the Trainer's best and the newest.
    policy = Policy(keep_last=1, best=1, metric="eval_loss", mode="min")
    assert set(kept(items, policy)) == {8, best_by_trainer}
    assert "best eval_loss" in kept(items, policy)[best_by_trainer]
