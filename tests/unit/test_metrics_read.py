"""Training metrics read at detection from the HF Trainer's trainer_state.json (for the remote
policy's best-K rule): the latest value of each name logged at or before the checkpoint's step."""
from __future__ import annotations

import json

from pipeline.detection.metrics import from_trainer_state, read


def test_the_latest_value_at_or_before_the_step_and_the_best_metric():
    state = {"global_step": 200, "best_metric": 0.71, "log_history": [
        {"loss": 2.5, "learning_rate": 1e-4, "epoch": 0.1, "step": 100},
        {"eval_loss": 0.9, "eval_runtime": 3.2, "epoch": 0.1, "step": 100},
        {"loss": 1.9, "grad_norm": float("nan"), "epoch": 0.2, "step": 200},
        {"eval_loss": 0.71, "epoch": 0.2, "step": 200},
        {"loss": 1.5, "step": 300},  # logged after this checkpoint (a later state copied in): ignored
    ]}
    assert from_trainer_state(state) == {"loss": 1.9, "learning_rate": 1e-4, "eval_loss": 0.71,
                                         "eval_runtime": 3.2, "best_metric": 0.71}


def test_nothing_usable_means_no_metrics(tmp_path):
    assert from_trainer_state([1, 2]) == {} and from_trainer_state({"log_history": "x"}) == {}
    assert from_trainer_state({"log_history": [{"ok": True, "name": "x"}]}) == {}
    bad = tmp_path / "trainer_state.json"
    bad.write_text("{not json")
    assert read([("trainer_state.json", str(bad), bad.stat().st_size)]) == {}
    good = tmp_path / "state.json"
    good.write_text(json.dumps({"global_step": 1, "log_history": [{"step": 1, "eval_loss": 0.5}]}))
    assert read([("trainer_state.json", str(good), good.stat().st_size)]) == {"eval_loss": 0.5}
    assert read([("nested/trainer_state.json", str(good), 10)]) == {}  # only the checkpoint's own
