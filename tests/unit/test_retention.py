"""Retention decisions (pure)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.retention import LocalCheckpoint as C
from pipeline.core.retention import newest_first, newest_ids, to_rotate
from pipeline.detection.roots import is_temporary, step_of


def test_keeps_the_newest_k_by_completion_time_then_step():
    # Written in step order: the newest completed last.
    items = [C(1, 100, 1.0), C(2, 200, 2.0), C(3, 300, 3.0), C(4, 400, 4.0)]
    assert to_rotate(items, 2) == [2, 1]
    # Same completion time (a coarse clock): the writer's step, then detection order.
    assert to_rotate([C(1, 100, 5.0), C(3, 300, 5.0), C(2, 200, 5.0)], 1) == [2, 1]


def test_a_save_without_a_step_written_last_is_the_newest():
    """HF ``trainer.save_model()`` after checkpoint-100/200/300: model.safetensors has no step."""
    items = [C(1, 100, 1.0), C(2, 200, 2.0), C(3, 300, 3.0), C(4, None, 4.0)]
    assert to_rotate(items, 1) == [2, 1]   # 4 newest by time; 3 the highest step: both stay
    assert to_rotate(items, 2) == [2, 1]


def test_when_in_doubt_keep_the_newest_by_every_measure():
    # A copy moved 1's time past the others; 3 has the highest step; 4 was detected last.
    items = [C(1, 100, 99.0), C(2, 200, 2.0), C(3, 300, 3.0), C(4, 50, 1.0)]
    assert to_rotate(items, 1) == [2]
    assert newest_ids(items, lambda c: c.mtime) == {1, 3, 4}


@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 50)), st.floats(0, 100)), max_size=12),
       st.integers(0, 5))
def test_rotation_never_takes_the_newest_and_keeps_keep_last(rows, keep_last):
    items = [C(i, step, mtime) for i, (step, mtime) in enumerate(rows)]
    gone = to_rotate(items, keep_last)
    left = [c for c in items if c.id not in gone]
    assert len(left) >= min(keep_last, len(items))
    if items:
        assert max(items, key=lambda c: (c.mtime, c.id)).id not in gone
        assert max(items, key=lambda c: c.id).id not in gone
        stepped = [c for c in items if c.step is not None]
        # Newest by step: of two saves of one step (a re-save), the one completed last.
        assert not stepped or max(stepped, key=lambda c: (c.step, c.mtime, c.id)).id not in gone
    # Everything it keeps beyond the newest by every measure is newer than all it rotates.
    kept_by_order = {c.id for c in newest_first(items)[:keep_last]}
    assert all(c.id in kept_by_order or c.id in newest_ids(items, lambda c: c.mtime) for c in left)


def test_step_numbers_compare_naturally_not_as_text():
    assert step_of("checkpoint-1000") == 1000 and step_of("step_000200") == 200
    assert step_of("step500_lr1e-4") == 500 and step_of("epoch=1-step=500.ckpt") == 500
    assert step_of("global_step500") == 500 and step_of("iter_0000500") == 500 and step_of("checkpoint_3") == 3
    assert step_of("500") == 500 and step_of("run_lr1e-4") is None and step_of("model.safetensors") is None
    assert step_of("step_" + "9" * 5000) is None  # a hostile run of digits is no step
    items = [C(1, step_of("checkpoint-900"), 0), C(2, step_of("checkpoint-1000"), 0)]
    assert to_rotate(items, 1) == [1]


def test_detection_order_breaks_ties_and_is_never_dropped():
    items = [C(1, None, 10.0), C(2, None, 20.0), C(3, None, 5.0)]
    assert to_rotate(items, 1) == [1]  # 2 completed last, 3 was detected last: both kept
    assert to_rotate([C(7, 100, 9.0), C(4, 100, 9.0), C(2, 100, 9.0)], 1) == [4, 2]


def test_keep_zero_rotates_everything_and_keep_many_nothing():
    items = [C(i, i, 0) for i in range(3)]
    assert sorted(to_rotate(items, 0)) == [0, 1]  # 2 is the newest: never rotated
    assert to_rotate(items, 5) == []


def test_temporary_names_are_not_checkpoints():
    for name in (".hidden", "x.tmp", "x.part", "ckpt.orbax-checkpoint-tmp-123", "a.lock"):
        assert is_temporary(name)
    for name in ("checkpoint-5", "model.safetensors", "step_1"):
        assert not is_temporary(name)


def test_the_files_of_one_save_side_by_side_are_kept_together():
    """save_pretrained(run, max_shard_size=...) into the run: five shards and an index, each its
    own checkpoint; the newest save keeps all of them, not only the file that completed last."""
    from pipeline.core.savegroups import save_group

    names = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)] + ["model.safetensors.index.json"]
    assert {save_group(n) for n in names} == {"model.safetensors"}
    assert save_group("checkpoint-5") == save_group("step_1.safetensors") == ""
    final = [C(10 + i, None, 3.0 + i / 10, save_group(n)) for i, n in enumerate(names)]
    items = [C(1, 100, 1.0), C(2, 200, 2.0), *final]
    assert to_rotate(items, 1) == [1]  # 2: highest step; 10..13: the newest save, whole
