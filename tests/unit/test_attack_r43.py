"""Round 43, from outside: histories no test named that still lose the newest save, delete
what is not safely elsewhere, or wedge a component. Each test documents a defect found against
main at cfbcf82 and FAILS there; its docstring gives the history and the safe behaviour
expected. (Written by the attack session; no pipeline code changed.)"""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.detection.watcher import Watcher
from pipeline.integrity import gc
from tests.unit.test_attack_i27 import _protect


def _current(settings, path: Path) -> Checkpoint | None:
    with session_scope(settings.db_url) as s:
        c = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
        if c is not None:
            s.expunge(c)
        return c


def _content(settings, ckpt_id: int) -> set[str]:
    with session_scope(settings.db_url) as s:
        return {sh.sha256 for f in s.get(Checkpoint, ckpt_id).files for sh in f.shards}


def test_a_sharded_final_model_in_the_run_saved_again_and_killed_after_one_shard_keeps_the_first_save(db, tmp_path):
    """History: ``trainer.save_model()`` (``save_pretrained`` into the output directory, the run
    itself, with ``max_shard_size``) writes ``model-00001-of-0000N.safetensors`` ...
    ``model-0000N-of-0000N.safetensors`` and ``model.safetensors.index.json`` beside the run's
    checkpoints: each file is recorded as a checkpoint of its own, and they are one save
    (``layouts.save_group``); all protected. The script runs again (a resumed job, a second
    phase) and ``save_model()`` saves again into the run, with the same shard names: it
    rewrites ``model-00001-of-0000N.safetensors`` and is killed (preempted) before it gets to
    the second shard and the index. The new first shard is a complete safetensors file, so it is
    recorded as the new version of its path: the first save's first shard is superseded,
    released, and garbage once the grace passes. The newest complete save of the run (the first
    ``save_model()``: old shard 1 + old shard 2 + index) can then be rebuilt from nothing: its
    shard 1 is overwritten on disk and collected remotely; what is on disk is a mix of two
    saves that no one made.

    Safe (as for a folder saved again, docs/design.md "The current version of a path is what
    is on disk now"): a file of a save written side by side into the run, saved again, does not
    release the version it replaces until the save it belongs to is complete again (its index
    is new), or at the least no content of the newest complete save is garbage while nothing
    complete replaced it."""
    from tests.unit.test_layouts_resave import SHARDED
    from tests.writers.write import tiny_qwen

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    tiny_qwen(1).save_pretrained(run, max_shard_size=SHARDED)  # the first trainer.save_model()
    shards = sorted(p.name for p in run.iterdir() if p.name.startswith("model-"))
    assert len(shards) >= 2, shards
    first = run / shards[0]
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    for name in [*shards, "model.safetensors.index.json"]:
        _protect(settings, run / name)
    v1 = _current(settings, first).id
    v1_content = _content(settings, v1)

    # The second save_model(), killed after its first shard: the same names, other weights.
    again = tmp_path / "again"
    tiny_qwen(2).save_pretrained(again, max_shard_size=SHARDED)
    assert sorted(p.name for p in again.iterdir() if p.name.startswith("model-")) == shards
    time.sleep(0.05)
    shutil.copyfile(again / shards[0], first)  # written in place, as safetensors' save_file does
    for _ in range(3):
        w.scan()
        time.sleep(0.02)
    second = _current(settings, run / shards[1]).id
    assert _content(settings, second) != _content(settings, _current(settings, first).id)
    with session_scope(settings.db_url) as s:
        lost = (v1_content - _content(settings, _current(settings, first).id)) & set(gc.garbage(s, settings))
        released = s.get(Checkpoint, v1).released_at
    assert not lost, (f"the newest complete save's {shards[0]} is garbage ({len(lost)} contents) while the save "
                      f"over it stopped after one shard")
    assert released is None, "the newest complete save's first shard was released for half a save"


def test_a_save_pretrained_folder_saved_again_and_killed_after_its_config_keeps_the_first_save(db, tmp_path):
    """History: ``model.save_pretrained("runs/r/final")`` (the hf-pretrained layout: config.json,
    generation_config.json, model.safetensors) is recorded and protected (v1), the run's newest
    save. The script then saves the final model again into the same folder in half precision
    (``model.half().save_pretrained(...)``, the usual last step before publishing); it writes
    config.json first (now ``"dtype": "float16"``), then generation_config.json, and is killed
    before ``model.safetensors``. Every file in the folder is complete by its own structure
    (JSON parses, the old safetensors file is whole), and the hf-pretrained row has no last
    file in ``layouts.resave_in_progress`` (only the quiet rule has the "some files did not
    change" guard of issue 27): the mix (new config, old float32 weights) is recorded at once
    as the folder's new version, v1 is superseded and released, and v1's config.json is garbage
    after the grace. The newest complete save exists nowhere whole (its config is overwritten
    on disk and collected remotely), and a restore of the "newest" gives a config that does not
    describe its weights.

    Safe: over a recorded version, a save_pretrained folder whose config changed while its
    weights file did not (save_pretrained writes the weights after the config) is a save in
    progress (flagged "changed on disk, not protected"), and v1 stays current and protected; in
    no case is v1's content garbage while nothing complete replaced it."""
    import torch

    from tests.writers.write import tiny_qwen

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    final = run / "final"
    tiny_qwen(1).save_pretrained(final)
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    v1 = _protect(settings, final)
    v1_content = _content(settings, v1)

    half = tmp_path / "half"
    tiny_qwen(1).to(torch.float16).save_pretrained(half)
    assert (half / "config.json").read_bytes() != (final / "config.json").read_bytes()
    time.sleep(0.05)
    shutil.copyfile(half / "config.json", final / "config.json")  # killed before model.safetensors
    for _ in range(3):
        w.scan()
        time.sleep(0.02)
    now = _current(settings, final)
    with session_scope(settings.db_url) as s:
        lost = (v1_content - _content(settings, now.id)) & set(gc.garbage(s, settings))
        released = s.get(Checkpoint, v1).released_at
    assert not lost, f"the newest complete save's config.json is garbage ({len(lost)} contents)"
    assert released is None, "the protected save was released for a save stopped after its config"
    assert now.id == v1, "a save_pretrained killed after its config was recorded as a new version"


def test_a_final_model_saved_by_trainer_save_model_into_its_own_folder_is_protected(db, tmp_path):
    """History: the end of most HF training scripts, ``trainer.save_model(f"{output_dir}/final")``
    (or ``"best"``, ``"epoch-1"``): ``Trainer._save`` writes ``save_pretrained`` (config.json,
    generation_config.json, model.safetensors) and then, "good practice", ``training_args.bin``
    into that folder; never ``trainer_state.json`` (``save_model`` is not ``_save_checkpoint``).
    The layout table recognises the hf-trainer row by ``training_args.bin`` alone and requires
    ``trainer_state.json``, "which the Trainer writes last": the finished final model is judged
    incomplete forever, is reported "stuck" after the quiet period and is never recorded, never
    copied anywhere. The run's newest save (docs/design.md names exactly ``trainer.save_model()``
    after ``checkpoint-300/`` as the run's newest) is protected by nothing; the ProtectCallback
    does not declare it either (it declares ``checkpoint-N`` in ``on_save`` only).

    Safe: a folder that holds a complete ``save_pretrained`` and ``training_args.bin`` and has no
    ``checkpoint-N`` name is the Trainer's ``save_model`` output, complete as the save_pretrained
    it is (the Trainer's ``checkpoint-N/`` keeps its trainer_state.json rule)."""
    from transformers import Trainer

    from tests.writers.write import Tokens, tiny_qwen, trainer_args

    settings = dataclasses.replace(db, quiet_seconds=0.0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    trainer = Trainer(model=tiny_qwen(2), args=trainer_args(run, max_steps=2, save_steps=2), train_dataset=Tokens())
    trainer.train()
    trainer.save_model(str(run / "final"))
    assert (run / "final" / "training_args.bin").exists() and (run / "final" / "model.safetensors").exists()
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    for _ in range(3):
        w.scan()
        time.sleep(0.05)
    with session_scope(settings.db_url) as s:
        names = sorted(s.scalars(select(Checkpoint.name).where(Checkpoint.current.is_(True))))
        from pipeline.db.models import DetectionProblem
        problems = [p.reason for p in s.scalars(select(DetectionProblem))]
    assert "final" in names, f"trainer.save_model(run/final) never recorded: recorded {names}; problems {problems}"


@pytest.mark.parametrize("protocol", [2, 4])  # 4: MEMOIZE numbers its values (the second attack's finding)
def test_a_legacy_torch_save_rewritten_in_place_and_killed_keeps_the_protected_version(db, tmp_path, protocol):
    """History: a run saves ``last.pt`` with the legacy serialization (``torch.save(...,
    _use_new_zipfile_serialization=False)``, as older training code and some frameworks still do;
    a pickle stream with no end marker: the quiet rule). It is recorded and protected (v1). At
    the next save the trainer opens ``last.pt`` for writing again (``torch.save`` truncates it)
    and is killed (preempted) half way through. Nothing changes any more; once the quiet period
    passes the half file is taken for a complete save, recorded as the path's new version, and
    v1 is superseded, released and garbage after the grace. The newest complete save (v1) is
    then nowhere: its local file is half overwritten, its remote content collected, and what is
    "protected" is half a pickle that no loader reads.

    This is issue 27's folder case (a re-save judged only by the quiet rule does not release the
    protected version it replaces) for a single file: ``layouts.resave_in_progress`` returns None
    for every file that is not a folder. Safe: over a protected version, content of a format with
    no end marker that is complete only because it went quiet does not release the protected
    version (flag it "changed on disk, not protected", or keep v1's content until the new one
    is proved whole); in no case is v1's content garbage."""
    import torch

    from tests.checkpoints import state_dict

    settings = dataclasses.replace(db, quiet_seconds=0.0, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    path = run / "last.pt"
    torch.save(state_dict(seed=1, layers=2, width=32), path, _use_new_zipfile_serialization=False,
               pickle_protocol=protocol)
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    v1 = _protect(settings, path)
    v1_content = _content(settings, v1)

    other = tmp_path / "other.pt"
    torch.save(state_dict(seed=2, layers=2, width=32), other, _use_new_zipfile_serialization=False,
               pickle_protocol=protocol)
    data = other.read_bytes()
    time.sleep(0.05)
    with open(path, "wb") as f:  # the next torch.save, killed half way
        f.write(data[: len(data) // 2])
    for _ in range(3):
        w.scan()
        time.sleep(0.02)
    with session_scope(settings.db_url) as s:
        lost = v1_content & set(gc.garbage(s, settings))
        released = s.get(Checkpoint, v1).released_at
    assert not lost, f"the protected save's content is garbage ({len(lost)} contents) after a save killed half way"
    assert released is None, "the protected save was released for half a file"


def test_wait_before_delete_waits_for_every_checkpoint_the_trainer_rotates_with_a_best_model_kept(tmp_path,
                                                                                                 monkeypatch):
    """History: an HF Trainer with ``ProtectCallback(wait_before_delete=True)``,
    ``save_total_limit=2`` and ``load_best_model_at_end=True`` (the usual pairing: keep the best
    and the latest). The Trainer's rotation (``transformers.trainer_utils.rotate_checkpoints``,
    run inside ``_save_checkpoint``, before ``on_save``) always keeps the most recent checkpoint
    and the best one, and deletes the others oldest first. Here the best (by eval loss) is
    checkpoint-4: the save of checkpoint-8 deletes checkpoint-6 at once (2 went earlier). The
    callback's ``at_risk`` assumes the Trainer deletes by step alone ("all but the newest
    ``limit - 1``"): at checkpoint-6's ``on_save`` it waited for checkpoint-4 only, and at
    checkpoint-8's (after the deletion) for checkpoint-4 again. checkpoint-6, declared moments
    before and possibly not yet hashed, recorded or copied, was never waited for: the Trainer
    deletes a checkpoint that may exist nowhere else, which is what ``wait_before_delete``
    promises never happens.

    Safe: ``at_risk`` counts what the Trainer's next rotation can delete with its own rule (the
    best checkpoint kept beside the newest), or simply waits for every checkpoint but the
    newest; every checkpoint the Trainer deletes was waited for before."""
    from transformers import Trainer

    from pipeline.integrations import transformers as integration
    from pipeline.integrations.protection import TrainerProtection
    from tests.writers.write import Tokens, tiny_qwen, trainer_args

    waited: list[str] = []
    monkeypatch.setattr(TrainerProtection, "saved", lambda self, path: None)
    monkeypatch.setattr(TrainerProtection, "start", lambda self, run: None)
    monkeypatch.setattr(TrainerProtection, "before_delete", lambda self, path, timeout: waited.append(
        (path, sorted(p.name for p in Path(path).parent.iterdir() if p.name.startswith("checkpoint-")))))
    deleted: list[tuple[str, list[str]]] = []
    import shutil as shutil_mod
    real_rmtree = shutil_mod.rmtree

    def rmtree(path, *a, **kw):
        deleted.append(str(path))
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr("transformers.trainer_utils.shutil.rmtree", rmtree)
    run = tmp_path / "runs" / "r"
    args = trainer_args(run, max_steps=8, save_steps=2, eval_strategy="steps", eval_steps=2, save_total_limit=2,
                        load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
    trainer = Trainer(model=tiny_qwen(2), args=args, train_dataset=Tokens(), eval_dataset=Tokens(n=16, seed=1),
                      callbacks=[integration.ProtectCallback(wait_before_delete=True)])
    trainer.train()
    assert not trainer.state.best_model_checkpoint.endswith("checkpoint-8"), "the best is the newest: no case"
    assert deleted, "the Trainer deleted nothing: the setup is not the one described"
    never = [p for p in deleted if p not in {w for w, _ in waited}]
    assert not never, (f"the Trainer deleted {[Path(p).name for p in never]} that the callback never waited for; "
                       f"it waited for {[(Path(w).name, seen) for w, seen in waited]}")
