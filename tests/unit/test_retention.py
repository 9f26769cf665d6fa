"""Retention decisions (pure)."""
from __future__ import annotations

from pipeline.core.retention import LocalCheckpoint as C
from pipeline.core.retention import to_rotate
from pipeline.detection.roots import is_temporary, step_of


def test_keeps_the_newest_k_by_step_number():
    items = [C(1, 100, 5.0), C(2, 300, 1.0), C(3, 200, 9.0), C(4, 50, 99.0)]
    assert to_rotate(items, 2) == [1, 4]


def test_step_numbers_compare_naturally_not_as_text():
    assert step_of("checkpoint-1000") == 1000 and step_of("step_000200") == 200
    assert step_of("step500_lr1e-4") == 500 and step_of("epoch=1-step=500.ckpt") == 500
    assert step_of("global_step500") == 500 and step_of("iter_0000500") == 500 and step_of("checkpoint_3") == 3
    assert step_of("500") == 500 and step_of("run_lr1e-4") is None and step_of("model.safetensors") is None
    assert step_of("step_" + "9" * 5000) is None  # a hostile run of digits is no step
    items = [C(1, step_of("checkpoint-900"), 0), C(2, step_of("checkpoint-1000"), 0)]
    assert to_rotate(items, 1) == [1]


def test_detection_order_breaks_ties_and_orders_unnumbered():
    items = [C(1, None, 10.0), C(2, None, 20.0), C(3, None, 5.0)]
    assert to_rotate(items, 1) == [2, 1]  # 3 was detected last: kept, whatever its mtime
    assert to_rotate([C(7, 100, 0.0), C(4, 100, 9.0)], 1) == [4]


def test_keep_zero_rotates_everything_and_keep_many_nothing():
    items = [C(i, i, 0) for i in range(3)]
    assert sorted(to_rotate(items, 0)) == [0, 1, 2]
    assert to_rotate(items, 5) == []


def test_temporary_names_are_not_checkpoints():
    for name in (".hidden", "x.tmp", "x.part", "ckpt.orbax-checkpoint-tmp-123", "a.lock"):
        assert is_temporary(name)
    for name in ("checkpoint-5", "model.safetensors", "step_1"):
        assert not is_temporary(name)
