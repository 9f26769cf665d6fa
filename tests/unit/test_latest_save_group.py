"""``latest()`` of a run whose newest save is several files side by side in the run itself
(``save_pretrained(run, max_shard_size=...)``, what ``trainer.save_model()`` writes into the
output directory): each shard and the index is a checkpoint of its own, and one save
(``savegroups.save_group``). What to resume from is the whole save, once every file of it is
protected; ``ckpt restore --latest`` then gives all of them back (tests/integration/
test_newest_save.py runs that against the real cluster)."""
from __future__ import annotations

import time

from pipeline import api
from pipeline.core.savegroups import whole_save
from pipeline.detection.watcher import Watcher
from tests.unit.test_attack_i27 import _protect
from tests.unit.test_layouts_resave import SHARDED

G = "model.safetensors"
INDEX = "model.safetensors.index.json"


def shard(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def test_whole_save_needs_the_index_and_every_shard_it_names():
    three = {shard(k, 3): 10.0 + k for k in (1, 2, 3)}
    assert whole_save(G, three) is None  # no index yet (written last)
    assert whole_save(G, {**three, INDEX: 20.0}) == [INDEX, shard(1, 3), shard(2, 3), shard(3, 3)]
    assert whole_save(G, {shard(1, 3): 1.0, shard(3, 3): 2.0, INDEX: 3.0}) is None  # a shard not recorded
    # Another group's files beside it are not part of it.
    other = {"adapter-00001-of-00001.safetensors": 30.0, "model.bin.index.json": 31.0,
             "model-00001-of-00001.bin": 31.0}
    assert whole_save(G, {**three, **other, INDEX: 20.0}) == [INDEX, shard(1, 3), shard(2, 3), shard(3, 3)]


def test_whole_save_is_the_set_of_shards_written_last_before_the_index():
    """Two counts of shards recorded beside one index: an earlier save's left beside (a writer
    that does not delete them, or their records after it did) and the save the index completes;
    or the index's save and a later one still being written (new names: no index yet). The
    index, written after its shards, names the set written last before it, whole or not."""
    old = {shard(k, 2): 5.0 + k for k in (1, 2)}
    new = {shard(k, 3): 10.0 + k for k in (1, 2, 3)}
    assert whole_save(G, {**old, **new, INDEX: 20.0}) == [INDEX, shard(1, 3), shard(2, 3), shard(3, 3)]
    # A later save of three shards killed after two: the index is still the two-shard save's.
    later = {shard(k, 3): 30.0 + k for k in (1, 2)}
    assert whole_save(G, {**old, **later, INDEX: 20.0}) == [INDEX, shard(1, 2), shard(2, 2)]
    # The index's own set lacks a shard (one never recorded): not an older save instead.
    assert whole_save(G, {**old, shard(1, 3): 11.0, shard(3, 3): 13.0, INDEX: 20.0}) is None


def test_latest_is_the_whole_sharded_save_in_the_run_once_every_file_is_protected(db, tmp_path):
    from tests.writers.write import tiny_qwen

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    tiny_qwen(0).save_pretrained(run / "pretrained-2")
    time.sleep(0.05)
    tiny_qwen(1).save_pretrained(run, max_shard_size=SHARDED)  # trainer.save_model() into the run
    shards = sorted(p.name for p in run.iterdir() if p.name.startswith("model-"))
    assert len(shards) >= 3, shards
    time.sleep(0.05)
    Watcher(db, [].extend, use_events=False).scan()

    first = _protect(db, run / "pretrained-2")
    assert api.latest(run, settings=db).id == first
    for name in shards:  # every shard protected, not yet the index: the save is not whole
        _protect(db, run / name)
    newest = api.latest(run, settings=db)
    assert newest.id == first, f"latest() answers {newest.path}, a file of a save not yet protected whole"

    index = _protect(db, run / INDEX)
    newest = api.latest(run, settings=db)
    assert newest.id == index
    assert [p.path for p in newest.parts] == [str(run / n) for n in shards]
    assert all(p.protected for p in newest.parts)


def test_latest_skips_a_sharded_save_whose_shard_is_not_protected(db, tmp_path):
    from tests.writers.write import tiny_qwen

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    tiny_qwen(0).save_pretrained(run / "pretrained-2")
    time.sleep(0.05)
    tiny_qwen(1).save_pretrained(run, max_shard_size=SHARDED)
    shards = sorted(p.name for p in run.iterdir() if p.name.startswith("model-"))
    Watcher(db, [].extend, use_events=False).scan()
    first = _protect(db, run / "pretrained-2")
    for name in [*shards[1:], INDEX]:  # the first shard still storing
        _protect(db, run / name)
    assert api.latest(run, settings=db).id == first
