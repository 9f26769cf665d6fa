"""Round 43, second look from outside, at the five mends of r43 (2a4bea9, e77781e). Each test
documents a defect that remains or was introduced by those mends and FAILS at 2a4bea9; its
docstring gives the history and the safe behaviour expected. (Written by the attack2 session;
no pipeline code changed.)"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.detection.watcher import Watcher
from pipeline.integrity import gc
from tests.unit.test_attack_r43 import _content, _current, _protect


def _names(settings, path: Path) -> set[str]:
    with session_scope(settings.db_url) as s:
        c = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
        return {f.relpath for f in c.files}


def _scans(w: Watcher, n: int = 3) -> None:
    for _ in range(n):
        w.scan()
        time.sleep(0.05)


# -- 4. the legacy torch.save reader ------------------------------------------------------------

def test_the_legacy_reader_returns_facts_for_a_pickle_whose_storage_keys_are_unhashable(tmp_path):
    """History: any file of a watched run that starts with byte 0x80 is read by
    ``formats.torch_legacy`` (a ``.pt`` someone drops in, a corrupted or hostile file). One that
    starts with the legacy magic pickle and whose fifth pickle (the storage keys) is a list
    holding a list (``[[0]]``) makes ``len(set(keys))`` raise TypeError, outside both ``try``
    blocks: ``file_facts`` (whose module promises it "raises only OSError") raises, the entry is
    the scan's error (backoff, reported as a failure), never a verdict.

    Safe: whatever the bytes, the reader returns a verdict (not judged: the quiet rule)."""
    from pipeline.detection.formats import _MAGIC_PICKLES, file_facts

    hostile = tmp_path / "x.pt"
    hostile.write_bytes(_MAGIC_PICKLES[0] + pickle.dumps(1001, 2) + pickle.dumps({}, 2) + pickle.dumps({}, 2)
                        + pickle.dumps([[0]], 2))
    try:
        facts, _ = file_facts("", str(hostile), hostile.stat().st_size, hostile.stat().st_mtime_ns)
    except OSError:
        raise
    except Exception as exc:
        raise AssertionError(f"file_facts raised {type(exc).__name__}: {exc}") from exc
    assert facts.format in ("pickle", "torch-legacy")


def _traced_peak(read) -> int:
    """Bytes allocated at most while ``read()`` runs (tracemalloc: deterministic, not timed)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        read()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_the_legacy_reader_does_not_build_what_a_pickle_under_its_byte_cap_describes():
    """History: ``torch_legacy`` capped the pickles it reads by their bytes but not what they
    build: two bytes (``}a``: EMPTY_DICT, APPEND) build a 64-byte dict and a list slot, so a
    file in a watched run starting like a legacy torch.save made the watcher build ~35 times its
    size (16 MiB -> ~570 MiB), on the watcher's thread, at every look while the file changes.

    Safe: the pickles are walked, not built: what the reader allocates does not grow with them."""
    from pipeline.detection.formats import _MAGIC_PICKLES, torch_legacy

    bomb = b"\x80\x02]" + b"}a" * (128 * 1024) + b"."  # 256 KiB: a list of empty dicts (built: ~9 MiB)
    data = _MAGIC_PICKLES[0] + bomb
    peak = _traced_peak(lambda: torch_legacy(io.BytesIO(data), len(data)))
    assert peak < 2**20, f"walking a 256 KiB pickle allocated {peak / 2**20:.1f} MiB"


def test_the_legacy_reader_hashes_nothing_the_file_describes():
    """History: a dict pickled with int keys that all hash alike (``k * (2**61 - 1)``: Python's
    int hash is not randomised) costs O(n) per insertion, O(n^2) in all, when the reader builds
    it: 1 MiB of such a pickle (55,000 keys) took ~20 s of the watcher's only scanning thread.

    Safe: nothing keyed by the file's content is built, so nothing it describes is hashed and
    the cost is linear in its bytes. Shown without a clock: a dict whose keys are lists, which
    building would refuse (unhashable), is walked through, and the file judged."""
    from pipeline.detection.formats import _MAGIC_PICKLES, torch_legacy

    n = 55_000
    obj = b"".join([b"\x80\x02}(", b"]N" * n, b"u."])  # {[]: None, ...}: SETITEMS of list keys
    with pytest.raises(TypeError):
        pickle.loads(obj)
    rest = pickle.dumps(1001, 2) + pickle.dumps({}, 2) + obj + pickle.dumps([], 2)
    data = _MAGIC_PICKLES[0] + rest
    assert torch_legacy(io.BytesIO(data), len(data)) == (True, None)


# -- 3. Trainer.save_model(dir): training_args.bin as the last file ----------------------------------------

def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(8)} | {"[UNK]": 8}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]")


def test_a_save_model_folder_completed_by_its_tokenizer_after_a_record_is_protected(db, tmp_path):
    """History: the usual end of a training script whose Trainer got no ``processing_class``:
    ``trainer.save_model(out/"final")`` then, after the final evaluation, ``tokenizer.save_pretrained(
    out/"final")`` (the HF docs' and most fine-tuning scripts' pair). r43 made ``final`` complete
    at ``training_args.bin``, "which save_model writes last", so the watcher records it (v1:
    config, weights, training_args.bin) before the tokenizer comes. The tokenizer files are
    then only ADDED beside an unchanged save, but ``resave_in_progress`` sees a change over a
    recorded version whose hf-trainer "last file" (training_args.bin) did not change: "saved
    again over its recorded version ... but not yet training_args.bin". That is never written
    again: the finished model (with its tokenizer: what anyone restores to use it) waits
    forever, flagged "changed, not protected". 2a4bea9 says of the same history for
    hf-pretrained: "files only added beside an unchanged config and weights are the rest of that
    save" -- the hf-trainer row's new save_model branch does not.

    Safe: files only added beside a recorded save_model folder are recorded as its new version
    (as for hf-pretrained), or the folder is not complete before they come."""
    from transformers import Trainer

    from tests.writers.write import Tokens, tiny_qwen, trainer_args

    settings = dataclasses.replace(db, quiet_seconds=0.0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    trainer = Trainer(model=tiny_qwen(2), args=trainer_args(run, max_steps=2, save_steps=2), train_dataset=Tokens())
    trainer.train()
    final = run / "final"
    trainer.save_model(str(final))
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    _scans(w, 2)
    assert "training_args.bin" in _names(settings, final), "the save_model folder was not recorded: no case"
    _tokenizer().save_pretrained(final)  # after trainer.evaluate(): the script's next line
    time.sleep(0.05)
    _scans(w)
    names = _names(settings, final)
    assert "tokenizer.json" in names, (f"the save_model folder completed by its tokenizer was never recorded "
                                       f"(recorded: {sorted(names)}); disk changed: {w.changes.__dict__!r}"[:600])


# -- 2. save_pretrained: a changed config waits for new weights -----------------------------------

def test_a_generation_config_updated_beside_a_recorded_save_pretrained_is_protected(db, tmp_path):
    """History: ``model.save_pretrained(run/"final")`` is recorded (v1). Then the script (or the
    user, before publishing) sets the generation defaults the documented way,
    ``model.generation_config.max_new_tokens = 256; model.generation_config.save_pretrained(final)``
    (GenerationConfig.save_pretrained writes generation_config.json only). r43's
    ``_WRITTEN_BEFORE`` takes any change of config.json OR generation_config.json with unchanged
    weights for a save_pretrained killed between them: the folder waits for new weights
    forever and the finished model's generation config is never protected. A killed
    save_pretrained cannot leave this state: it writes config.json BEFORE generation_config.json,
    and config.json here did not change.

    Safe: a folder whose generation_config.json alone changed (config.json and weights as
    recorded) is a new version, recorded."""
    from tests.writers.write import tiny_qwen

    settings = dataclasses.replace(db, quiet_seconds=0.0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    final = run / "final"
    model = tiny_qwen(1)
    model.save_pretrained(final)
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    v1 = _protect(settings, final)
    before = (final / "generation_config.json").stat()
    model.generation_config.max_new_tokens = 256
    model.generation_config.save_pretrained(final)
    assert (final / "generation_config.json").stat().st_mtime_ns != before.st_mtime_ns
    time.sleep(0.05)
    _scans(w)
    now = _current(settings, final)
    assert now.id != v1, (f"generation_config.json updated beside a recorded save_pretrained is never recorded: "
                          f"{w.changes.__dict__!r}"[:600])


def test_a_pipeline_folder_saved_again_and_killed_after_a_component_config_keeps_the_first_save(db, tmp_path):
    """History: a diffusers-style pipeline folder (``DiffusionPipeline.save_pretrained``:
    ``model_index.json``, then each component's ``save_pretrained`` into its subfolder in turn:
    ``text_encoder/{config.json,model.safetensors}``, ``unet/{config.json,
    diffusion_pytorch_model.safetensors}``...; the same for any folder of several models) is
    recorded and protected (v1). It is saved again and killed after ``text_encoder`` was
    rewritten whole and ``unet/config.json`` was written, before the unet's weights. r43's rule
    asks "a config changed and NO weights file changed": the text encoder's new weights count as
    the weights that came after ``unet/config.json``, so the mix (new text encoder, new unet
    config, OLD unet weights) is recorded at once (every file is complete by its structure), v1
    is released, and its content garbage after the grace: what the unet config describes is not
    its weights, and the last complete pipeline is gone.

    Safe: the config-then-weights rule holds per folder (each save_pretrained's config against
    its own weights); v1 stays current and protected until a complete save replaces it."""
    import torch

    from tests.writers.write import tiny_qwen

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    pipe = run / "pipeline"

    def save_pipeline(dest: Path, te, unet) -> None:
        dest.mkdir(exist_ok=True)
        (dest / "model_index.json").write_text(json.dumps({"_class_name": "Pipe", "text_encoder": ["t", "T"],
                                                           "unet": ["t", "T"]}))
        te.save_pretrained(dest / "text_encoder")
        unet.save_pretrained(dest / "unet")

    save_pipeline(pipe, tiny_qwen(1), tiny_qwen(2))
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    v1 = _protect(settings, pipe)
    v1_content = _content(settings, v1)

    staged = tmp_path / "staged"
    save_pipeline(staged, tiny_qwen(3), tiny_qwen(4).to(torch.float16))
    time.sleep(0.05)
    # the second save, killed after unet/config.json: model_index.json, text_encoder whole, unet config
    shutil.copyfile(staged / "model_index.json", pipe / "model_index.json")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copyfile(staged / "text_encoder" / name, pipe / "text_encoder" / name)
    shutil.copyfile(staged / "unet" / "config.json", pipe / "unet" / "config.json")
    _scans(w)
    now = _current(settings, pipe)
    with session_scope(settings.db_url) as s:
        lost = (v1_content - _content(settings, now.id)) & set(gc.garbage(s, settings))
        released = s.get(Checkpoint, v1).released_at
    assert not lost, f"the last complete pipeline's content is garbage ({len(lost)} contents)"
    assert released is None and now.id == v1, "a pipeline save killed after a component's config was recorded"


# -- 5. at_risk against the Trainer's own rotation --------------------------------------------------

def _rotated(run: Path, limit: int, best: str | None) -> list[str]:
    """What ``transformers.trainer_utils.rotate_checkpoints`` deletes in ``run`` now (as
    ``Trainer._save_checkpoint`` calls it: use_mtime=True)."""
    from transformers.trainer_utils import rotate_checkpoints

    before = {p.name for p in run.iterdir()}
    rotate_checkpoints(output_dir=str(run), save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)
    return sorted(before - {p.name for p in run.iterdir()})


def test_at_risk_counts_the_checkpoint_the_trainer_deletes_when_two_have_the_same_mtime(tmp_path):
    """History: ``save_total_limit=2``, ``ProtectCallback(wait_before_delete=True)``, on a
    filesystem whose times have a coarse grain (1 s or 2 s: NFSv3 exports of ext3, FAT/exFAT
    scratch disks, several FUSE stores) or checkpoints copied/restored with their times kept: at
    checkpoint-1000's ``on_save`` the folder holds checkpoint-500 and checkpoint-1000 with the same
    modification time (the run's first checkpoints are a second apart). The Trainer sorts by
    ``(mtime, path)``: on a tie the PATH STRING decides, and ``".../checkpoint-1000" <
    ".../checkpoint-500"``, so its next rotation (checkpoint-1500, two seconds later) deletes
    checkpoint-1000. ``at_risk`` breaks ties by step in both its orders and waits for
    checkpoint-500 only: checkpoint-1000, declared moments before, is deleted without a wait.

    Safe: at_risk counts every checkpoint the Trainer's rule can delete (ties broken as the
    Trainer does, by path string; or every order of tied times)."""
    from pipeline.integrations.transformers import at_risk

    run = tmp_path / "out"
    t0 = time.time() - 100
    for step in (500, 1000):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        os.utime(run / f"checkpoint-{step}", (t0, t0))
    waited = [Path(p).name for p in at_risk(str(run), 2, None)]
    (run / "checkpoint-1500").mkdir()
    os.utime(run / "checkpoint-1500", (t0 + 2, t0 + 2))
    deleted = _rotated(run, 2, None)
    assert set(deleted) <= set(waited), f"the Trainer deleted {deleted}; at_risk waited for {waited}"


def test_at_risk_counts_every_folder_the_trainer_counts(tmp_path):
    """History: ``save_total_limit=2`` with ``wait_before_delete``; the script (or a callback)
    keeps an export beside the Trainer's checkpoints under a ``checkpoint-`` name (a merged LoRA
    ``checkpoint-1000-merged``, a ``checkpoint-best`` copy). ``rotate_checkpoints`` with
    use_mtime (the Trainer's call) lists ``glob("checkpoint-*")``: every such folder counts
    towards the limit and is deleted like a checkpoint. ``at_risk`` lists ``^checkpoint-\\d+$``
    only: it predicts one deletion (checkpoint-500) where the Trainer makes two, and
    checkpoint-1000 (the newest before the save) is deleted without a wait.

    Safe: at_risk lists the checkpoints as the Trainer does (its glob), so that what it
    waits for covers what the next rotation deletes."""
    from pipeline.integrations.transformers import at_risk

    run = tmp_path / "out"
    t0 = time.time() - 100
    for i, name in enumerate(("checkpoint-500", "checkpoint-1000", "checkpoint-1000-merged")):
        (run / name).mkdir(parents=True)
        os.utime(run / name, (t0 + 10 * i, t0 + 10 * i))
    waited = [Path(p).name for p in at_risk(str(run), 2, None)]
    (run / "checkpoint-1500").mkdir()
    os.utime(run / "checkpoint-1500", (t0 + 40, t0 + 40))
    deleted = [d for d in _rotated(run, 2, None) if d != "checkpoint-1000-merged"]
    assert set(deleted) <= set(waited), f"the Trainer deleted {deleted}; at_risk waited for {waited}"
