"""Issue 27, from outside: histories no test named that still lose or hide the newest save,
delete what is not safely elsewhere, or wedge a component. Each test documents a defect found
against main at the issue-27 merge (3161bd0) and FAILS there; its docstring gives the history
and the safe behaviour expected. (Written by the attack session; no pipeline code changed.)"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, DetectionProblem
from pipeline.db.transitions import transition
from pipeline.detection import catalog
from pipeline.detection.watcher import Watcher
from pipeline.integrity import gc
from tests.checkpoints import state_dict


def _protect(settings, path: Path) -> int:
    """The current version at ``path``, its store job taken to verified."""
    with session_scope(settings.db_url) as s:
        ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
        job = catalog.latest_store_job(s, ckpt.id)
        for a, b in [("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")]:
            transition(s, job.id, "store", a, b)
        return ckpt.id


def _current(settings, path: Path) -> Checkpoint:
    with session_scope(settings.db_url) as s:
        c = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
        s.expunge(c)
        return c


def _deepspeed_like(folder: Path, seed: int, *, files: tuple[str, ...]) -> None:
    """DeepSpeed's engine.save_checkpoint layout (global_stepN/ of torch.save files, one per
    rank and kind, written one after the other); no row of the layout table recognises it."""
    folder.mkdir(exist_ok=True)
    for i, name in enumerate(files):
        torch.save(state_dict(seed=seed * 10 + i, layers=2, width=32), folder / name)


DS_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_a_resave_of_an_unknown_layout_killed_between_files_does_not_release_the_protected_version(db, tmp_path):
    """History: a DeepSpeed-style folder ``global_step300/`` (two torch.save files, a layout
    the table does not know: complete once quiet) is saved, recorded and protected (v1). The
    job restarts, redoes step 300 and saves again into the same folder; it is killed after
    rewriting the model states, before the optimizer states. Each file is a complete torch
    zip; the folder is quiet. The watcher records the mix as v2 (new model + old optimizer),
    v1 is superseded and released, and once the collection's grace passes v1's model states
    are garbage: the newest complete save (v1) then exists nowhere (its local files are
    overwritten, its remote content collected), and v2 is not a save anyone made.

    Safe: over a protected version, a re-save whose completion is only judged by the quiet
    rule and that leaves some recorded files untouched is not taken for a new version by the
    quiet period alone (flagged "changed on disk, not protected", as for the known layouts),
    or at least the version it replaces is not released until the new one is protected; in
    no case is v1's content garbage while nothing complete replaced it."""
    settings = dataclasses.replace(db, quiet_seconds=0.0, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    step = run / "global_step300"
    _deepspeed_like(step, seed=1, files=DS_FILES)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    v1 = _protect(settings, step)
    with session_scope(settings.db_url) as s:
        v1_model = {sh.sha256 for f in s.get(Checkpoint, v1).files if f.relpath == DS_FILES[0] for sh in f.shards}
    time.sleep(0.02)
    # The restart's save, killed after its first file: the model states are new, the
    # optimizer states still the old save's.
    torch.save(state_dict(seed=99, layers=2, width=32), step / DS_FILES[0])
    for _ in range(3):
        w.scan()
    with session_scope(settings.db_url) as s:
        assert not v1_model & set(gc.garbage(s, settings)), "the protected version's weights became garbage"
        assert s.get(Checkpoint, v1).released_at is None
    assert _current(settings, step).id == v1, "a re-save killed between two files was recorded as a new version"


def _trainer_checkpoint(folder: Path, step: int) -> Path:
    """What the HF Trainer leaves in ``checkpoint-N/``: save_pretrained, then trainer_state.json
    (written last) with its global_step."""
    return _trainer_checkpoint_with(folder, step, seed=step)


def _trainer_checkpoint_with(folder: Path, step: int, *, seed: int) -> Path:
    import json

    from tests.writers.write import tiny_qwen

    tiny_qwen(seed).save_pretrained(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return folder


def _run_with_final(settings, run: Path) -> tuple[Watcher, dict[str, int]]:
    """checkpoint-100, checkpoint-200 and a stepless ``final/`` (save_pretrained) in ``run``,
    each detected by a watcher and protected, in that order: name -> checkpoint id."""
    from tests.writers.write import tiny_qwen

    w = Watcher(settings, [].extend, use_events=False)
    ids = {}
    for name in ("checkpoint-100", "checkpoint-200", "final"):
        folder = run / name
        if name == "final":
            tiny_qwen(7).save_pretrained(folder)
        else:
            _trainer_checkpoint(folder, int(name.split("-")[1]))
        time.sleep(0.05)
        w.scan()
        ids[name] = _protect(settings, folder)
    return w, ids


def test_a_copy_of_an_old_checkpoint_in_the_run_never_costs_the_newest_save_its_protection(db, tmp_path):
    """History: an HF run saves checkpoint-100, checkpoint-200, then ``trainer.save_model()``
    writes the final model to ``final/`` (no step anywhere: the issue's first row). Every save
    is protected. The user then brings checkpoint-200 back inside the run to look at it
    (``ckpt restore <id> --to runs/r/inspect``, the restore roots being the watched roots, or
    ``cp -r checkpoint-200 inspect``): a new checkpoint, same bytes as checkpoint-200, with
    the newest file times and the highest id. ``newest_ids`` now names ``inspect`` twice
    (completion time, detection order) and checkpoint-200 (step): ``final``, the newest save
    any writer made, is newest by no measure. A remote ``keep_last 1`` forgets it, local
    ``keep_last 1`` rotates it (verified), ``--latest``/``latest()`` answer the copy of
    step 200; after the collection's grace the final model exists nowhere.

    Safe: a checkpoint whose content is an older protected checkpoint's (same files, same
    bytes) completed when that one did, not when it was copied: it never outranks a save made
    since. The final model stays the run's newest: kept by the policy, not rotated, and what
    ``latest()`` returns."""
    import shutil

    from pipeline import api
    from pipeline.integrity import retention
    from pipeline.store.rotation import rotation_candidates

    settings = dataclasses.replace(db, remote_keep_last=1, keep_last=1)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w, ids = _run_with_final(settings, run)
    time.sleep(0.05)
    # The user's copy (a restore writes new files the same way: new times, same bytes).
    shutil.copytree(run / "checkpoint-200", run / "inspect", copy_function=shutil.copyfile)
    time.sleep(0.05)
    w.scan()
    ids["inspect"] = _protect(settings, run / "inspect")

    newest = api.latest(run, settings=settings)
    assert newest is not None and newest.id == ids["final"], f"latest() answers {newest and newest.path}"
    with session_scope(settings.db_url) as s:
        verdicts = {v.checkpoint_id: v for v in retention.plan_run(s, settings, str(run))}
        assert verdicts[ids["final"]].keep, f"the final model is dropped: {verdicts[ids['final']].why}"
        assert ids["final"] not in rotation_candidates(s, str(run), settings.keep_last, settings.host_id)


def test_overwrite_with_other_content_never_makes_the_replaced_protected_version_garbage(db, tmp_path):
    """History: a run has checkpoint-300 and checkpoint-500 (its newest), both protected. The
    user means to restore checkpoint-300 somewhere and types the newest folder as the target:
    ``ckpt restore <id of 300> --to runs/r/checkpoint-500 --overwrite``. The request is
    accepted (checkpoint-500 is "a protected checkpoint's restorable content: every byte in
    it is kept by the workers, so replacing it loses nothing", pipeline/restoring/destination.py),
    the actor writes step 300's bytes there, and the watcher records them as the new version
    of checkpoint-500: the real step 500 is superseded, released, and garbage once the
    collection's grace passes. The newest save is then nowhere, and the path named
    checkpoint-500 holds step 300 (the restore is emulated below by writing exactly the bytes
    the actor would write: the decision that allows it and everything after it are real).

    Safe: an overwrite replaces only content that stays restorable: either it is refused
    when the target is a protected checkpoint's path and the restore would put other content
    there (restoring a checkpoint over its own path stays allowed), or the version it replaces
    keeps its content (not released by the supersede a restore causes) until a policy or
    ``ckpt forget`` drops it, like any protected version."""
    import shutil

    from pipeline.restoring import job as restore_job

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w = Watcher(settings, [].extend, use_events=False)
    ids = {}
    for step in (300, 500):
        _trainer_checkpoint(run / f"checkpoint-{step}", step)
        time.sleep(0.05)
        w.scan()
        ids[step] = _protect(settings, run / f"checkpoint-{step}")
    with session_scope(settings.db_url) as s:
        v500 = {sh.sha256 for f in s.get(Checkpoint, ids[500]).files for sh in f.shards}
        v300 = {sh.sha256 for f in s.get(Checkpoint, ids[300]).files for sh in f.shards}
        only_500 = v500 - v300
        assert only_500
        try:
            restore_job.validate(s, settings, str(ids[300]), str(run / "checkpoint-500"), overwrite=True)
        except Exception:
            return  # refused: safe
    # What the actor does once allowed: step 300's bytes, in place of checkpoint-500.
    target = run / "checkpoint-500"
    shutil.rmtree(target)
    shutil.copytree(run / "checkpoint-300", target, copy_function=shutil.copyfile)
    time.sleep(0.05)
    w.scan()
    with session_scope(settings.db_url) as s:
        lost = only_500 & set(gc.garbage(s, settings))
        assert not lost, f"{len(lost)} contents only the replaced newest save held are garbage"
        assert s.get(Checkpoint, ids[500]).released_at is None, "the real step 500 was released"


def test_a_file_linked_inside_a_checkpoint_is_protected_or_named_and_never_wedges_it(db, tmp_path):
    """History: a run's checkpoint folder holds its weights and a tokenizer file that is a
    symlink to the run's shared copy (``tokenizer.json -> ../tokenizer.json``, what a
    ``cp -rs``/``ln -s`` of the base model's files or a hub snapshot leaves), the link staying
    inside the root. Detection never follows a link inside an entry and says nothing: the
    checkpoint is recorded and protected without the file (status shows no problem, nothing
    lists it under "not protected"). Then ``ondisk.differs`` walks the folder, meets the link
    and calls the unchanged folder "changed after it was stored": rotation is blocked for
    ever ("tokenizer.json was added ... after it was stored"), so the training disk never
    gets that space back, and ``ckpt restore PATH`` refuses with "changed on disk" although
    nothing changed.

    Safe: one rule for a link inside an entry, used by detection, rotation and restore by
    path alike: either followed while it stays inside the root (its bytes recorded under the
    name the user sees), or named (a detection problem listing it as not protected) and
    ignored the same way by ``differs``. In no case does an unchanged folder count as changed
    on disk."""
    from pipeline.detection.ondisk import differs
    from pipeline.restoring import job as restore_job

    run = tmp_path / "runs" / "r"
    run.mkdir()
    (run / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')  # a run file
    folder = run / "checkpoint-100"
    _trainer_checkpoint(folder, 100)
    os.symlink("../tokenizer.json", folder / "tokenizer.json")
    time.sleep(0.05)
    w = Watcher(db, [].extend, use_events=False)
    w.scan()
    cid = _protect(db, folder)
    with session_scope(db.db_url) as s:
        ckpt = s.get(Checkpoint, cid)
        recorded = {f.relpath for f in ckpt.files}
        named = s.scalars(select(DetectionProblem.path)).all()
        assert "tokenizer.json" in recorded or any("tokenizer.json" in p for p in named), \
            "a file of the checkpoint was silently left out: neither protected nor named"
        assert differs(folder, True, catalog.own_files(ckpt)) is None, \
            "the unchanged folder counts as changed on disk (rotation blocked for ever)"
        restore_job.validate(s, db, str(folder), str(run / "restored"))


def test_content_saved_again_after_its_version_was_forgotten_is_protected_again(db, tmp_path):
    """History: an export script writes the final model to ``export/`` (save_pretrained of
    checkpoint-100's weights); it is protected. Training goes on: checkpoint-200 is saved and
    protected, and the remote policy ``keep_last 1`` forgets ``export/`` (not the newest then).
    Later the user runs the export script again: the same weights, saved again to the same
    folder, byte for byte the forgotten version. ``catalog.record`` finds that version and
    returns it as it is ("a forgotten checkpoint stays forgotten"): the newest save of the run
    is never stored again, ``ckpt restore export/`` refuses ("forgotten"), ``latest()`` does
    not know it, and once newer saves push it beyond the local ``keep_last`` the rotation
    (FORGOTTEN is rotatable) deletes it and the collection takes its content: the save the
    user just made is nowhere.

    Safe: a save completed after its version was forgotten is a new save: it gets a new store
    job (its unchanged shards are not sent again), is protected like any other, and the
    policy judges it afresh (it is the newest now)."""
    from pipeline import api
    from pipeline.integrity import retention
    from tests.writers.write import tiny_qwen

    settings = dataclasses.replace(db, remote_keep_last=1)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w = Watcher(settings, [].extend, use_events=False)
    export = run / "export"
    tiny_qwen(100).save_pretrained(export)
    time.sleep(0.05)
    w.scan()
    first = _protect(settings, export)
    _trainer_checkpoint(run / "checkpoint-200", 200)
    time.sleep(0.05)
    w.scan()
    _protect(settings, run / "checkpoint-200")
    with session_scope(settings.db_url) as s:
        gone = retention.apply_policy(s, settings)
        assert [v.checkpoint_id for v in gone] == [first]
    time.sleep(0.05)
    import shutil

    shutil.rmtree(export)
    tiny_qwen(100).save_pretrained(export)  # the export again: the same bytes
    time.sleep(0.05)
    w.scan()
    now = _current(settings, export)
    with session_scope(settings.db_url) as s:
        assert now.id != first or catalog.latest_store_job(s, now.id).state != "forgotten", \
            "the run's newest save is forgotten the moment it is made, and never stored"
    _protect(settings, export)  # stored again (its shards are already on the workers)
    newest = api.latest(run, settings=settings)
    assert newest is not None and newest.path == str(export)


def test_a_sharded_dcp_write_that_failed_is_written_again_not_copied(tmp_path, sharded_dcp, monkeypatch):
    """The session's written saves (tests/conftest.py ``sharded_dcp``): a write that failed (its
    port taken between ``free_port`` and the ranks' bind, a rank killed) leaves nothing the next
    test copies: it is written again, not copied empty or with one rank's files, which would turn
    one failure into a wrong save under every later test of the process."""
    import pipeline.cluster.client

    class PortTaken(OSError):
        pass

    def taken() -> int:
        raise PortTaken("the port was taken")

    monkeypatch.setattr(pipeline.cluster.client, "free_port", taken)
    seed = 9_310_417  # no other test's: the session keeps what it wrote per seed
    for attempt in ("first", "second"):
        try:
            sharded_dcp(tmp_path / attempt, seed)
        except PortTaken:
            continue
        raise AssertionError(f"the {attempt} call did not write: it copied {sorted(os.listdir(tmp_path / attempt))}")


def test_a_sharded_dcp_save_without_collectives_is_not_complete_with_one_ranks_files(db, tmp_path, sharded_dcp):
    """History: two ranks save FSDP2-sharded weights with ``dcp.save(...,
    use_collectives=False)`` (what ``async_save`` without collectives does on a job that avoids
    a barrier). Ranks are not synchronised: rank 0 finishes ``__0_0.distcp`` and renames
    ``__0.metadata`` into place while rank 1, a straggler (or a rank killed by a node failure),
    has not created a file yet. The layout rule ("every rank whose data files are there has
    its own metadata") is met by rank 0 alone, so the watcher records and protects a step
    that holds the first half of every tensor: it is the run's newest, so a remote
    ``keep_last 1`` forgets the previous complete step and the rotation deletes it locally;
    after the collection, the newest save anyone can restore cannot be loaded. Yet rank 0's
    own ``__0.metadata`` says so: each tensor's global size is 128 rows and its chunks cover
    only rows 0-63.

    Safe: a save without collectives is complete only when the chunks the present ranks'
    metadata record cover every tensor's global size (a rank whose chunks are missing is
    waited for, then reported as stuck, never recorded as a checkpoint)."""
    import shutil

    run = tmp_path / "runs" / "r"
    run.mkdir()
    whole = tmp_path / "written" / "step_2"
    whole.parent.mkdir()
    sharded_dcp(whole, seed=2)
    assert sorted(p.name for p in whole.iterdir()) == ["__0.metadata", "__0_0.distcp", "__1.metadata",
                                                        "__1_0.distcp"]
    # What the run's folder holds while rank 1 has not written (yet, or ever).
    step = run / "step_2"
    step.mkdir()
    for name in ("__0_0.distcp", "__0.metadata"):
        shutil.copy2(whole / name, step / name)
    w = Watcher(db, [].extend, use_events=False)  # the default quiet period: not what decides here
    w.scan()
    with session_scope(db.db_url) as s:
        recorded = s.scalars(select(Checkpoint.path)).all()
    assert str(step) not in recorded, "half of every tensor was recorded as a complete checkpoint"


def test_a_sharded_final_model_saved_into_the_run_is_one_save_not_one_per_file(db, tmp_path):
    """History: the issue's first row, sharded. An HF run saves checkpoint-100 and
    checkpoint-200, then ``trainer.save_model()`` (``save_pretrained`` into the output
    directory, the run itself) writes the final model with ``max_shard_size``:
    ``model-00001-of-00005.safetensors`` ... ``model-00005-of-00005.safetensors`` and
    ``model.safetensors.index.json`` beside the checkpoints (its config.json and tokenizer files
    are run files: never protected, never named). Each file is recorded as its own checkpoint
    of the run, without a step; ``newest_ids`` keeps the one that completed last, the one
    detected last and checkpoint-200 (highest step), so most shards of the final model are
    newest by no measure: the remote policy ``keep_last 1`` forgets it and the local
    ``keep_last 2`` rotates it; after the collection the run's newest save (the final model)
    cannot be rebuilt from anything.

    Safe: the files one save writes into a run are one save: a shard family and its index
    (and the config beside them) are recorded, kept and rotated together, or at the least every
    file of the newest save is kept by the newest-save rule; nothing of the final model is
    forgotten or rotated while it is the run's newest."""
    from pipeline.integrity import retention
    from pipeline.store.rotation import rotation_candidates
    from tests.unit.test_layouts_resave import SHARDED
    from tests.writers.write import tiny_qwen

    settings = dataclasses.replace(db, remote_keep_last=1, keep_last=2)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w = Watcher(settings, [].extend, use_events=False)
    for step in (100, 200):
        _trainer_checkpoint(run / f"checkpoint-{step}", step)
        time.sleep(0.05)
        w.scan()
        _protect(settings, run / f"checkpoint-{step}")
    time.sleep(0.05)
    tiny_qwen(9).save_pretrained(run, max_shard_size=SHARDED)  # trainer.save_model(): into the run
    final = sorted(p.name for p in run.iterdir() if p.name.startswith("model"))
    assert "model.safetensors.index.json" in final and len(final) >= 3, final  # 5 shards and their index
    time.sleep(0.05)
    w.scan()
    with session_scope(settings.db_url) as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.current.is_(True))).all()
        of_final = {c.id: c.name for c in rows if c.name.startswith("model")}
        paths = [Path(c.path) for c in rows if c.name.startswith("model")]
    for path in paths:
        _protect(settings, path)
    with session_scope(settings.db_url) as s:
        dropped = {of_final[v.checkpoint_id] for v in retention.plan_run(s, settings, str(run))
                   if not v.keep and v.checkpoint_id in of_final}
        rotated = {of_final[c] for c in rotation_candidates(s, str(run), settings.keep_last, settings.host_id)
                   if c in of_final}
    assert not dropped, f"files of the final model the remote policy forgets: {sorted(dropped)}"
    assert not rotated, f"files of the final model the rotation deletes: {sorted(rotated)}"


def test_a_committed_rotations_leftover_is_never_put_back_over_a_newer_version(db, tmp_path):
    """History: checkpoint-200 (v1) is verified and rotated; the rotation commits and the
    process dies before it deletes its trash entry (``.ckpt-trash-XXXXXXXX-checkpoint-200``,
    what ``pipeline.store.trash`` leaves then; the next rotation planning of the run would
    remove it). Before that planning runs, training restarted from checkpoint-100 redoes step
    200 and saves checkpoint-200 again (v2, new weights): recorded, verified, the run's newest.
    Then checkpoint-200 is deleted locally (the Trainer's ``save_total_limit``, or the user):
    v2 is protected, so its remote copies must stay. The watcher sees the path gone and calls
    ``trash.put_back``, which finds exactly one trash entry for that name and renames it back:
    v1's files reappear at checkpoint-200. The next scan records them as the path's current
    version (v1 again) and supersedes v2: released, garbage after the grace. The newest save,
    protected and never chosen to be replaced by anyone, is collected; checkpoint-200 holds the
    old weights again.

    Safe: ``put_back`` restores only the entry of a rotation that did not commit (the trash
    entry says which version or job it holds, and the caller's row must be that one); a
    leftover of a committed rotation is only ever deleted. A protected version whose files go
    is marked as gone locally, never superseded by files nobody wrote."""
    import shutil

    from pipeline.store import trash

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w = Watcher(settings, [].extend, use_events=False)
    path = run / "checkpoint-200"
    _trainer_checkpoint(path, 200)
    time.sleep(0.05)
    w.scan()
    v1 = _protect(settings, path)
    # The rotation of v1 as a crash after its commit leaves it: renamed into the trash, the
    # job rotated and the local copy recorded gone, the trash entry not deleted yet.
    trash.move_to_trash(path, inside=run.parent)
    with session_scope(settings.db_url) as s:
        transition(s, catalog.latest_store_job(s, v1).id, "store", "verified", "rotated")
        s.get(Checkpoint, v1).local_present = False
    w.scan()
    # Step 200 saved again (other weights), recorded and protected: the run's newest.
    _trainer_checkpoint_with(path, 200, seed=2200)
    time.sleep(0.05)
    w.scan()
    v2 = _current(settings, path).id
    assert v2 != v1
    _protect(settings, path)
    with session_scope(settings.db_url) as s:
        only_v2 = ({sh.sha256 for f in s.get(Checkpoint, v2).files for sh in f.shards}
                   - {sh.sha256 for f in s.get(Checkpoint, v1).files for sh in f.shards})
    shutil.rmtree(path)  # the trainer's own rotation deletes it
    for _ in range(3):
        w.scan()
        time.sleep(0.02)
    with session_scope(settings.db_url) as s:
        assert path.exists() is False or _current(settings, path).id == v2, "another version's files came back"
        assert not only_v2 & set(gc.garbage(s, settings)), "the protected newest version's content is garbage"
        assert s.get(Checkpoint, v2).released_at is None, "the protected newest version was released"
