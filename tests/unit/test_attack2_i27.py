"""Issue 27, from outside, second round: histories no test named that still lose or hide the
newest save after the first attack round's fixes (tests/unit/test_attack_i27.py). Each test
documents a defect found at fa6e7f3 and FAILS there; its docstring gives the history and the
safe behaviour expected. (Written by the second attack session; no pipeline code changed.)"""
from __future__ import annotations

import dataclasses
import shutil
import time

from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.detection.watcher import Watcher
from tests.unit.test_attack_i27 import _protect, _run_with_final, _trainer_checkpoint


def test_a_copy_copied_again_never_outranks_the_newest_save(db, tmp_path):
    """History: an HF run saves checkpoint-100, checkpoint-200 and the stepless final model
    ``final/`` (all protected). The user brings checkpoint-200 back into the run as
    ``inspect/`` (a copy: it takes checkpoint-200's completion time, the first round's fix),
    then copies it there once more (``cp -r`` again, or the same ``ckpt restore --to
    runs/r/inspect --overwrite`` a second time). The watcher sees new file times, hashes the
    same version at the same path, and ``catalog._completed_again`` sets the copy's completion
    time to *now*. ``inspect`` is now the newest by completion time and by detection order,
    and (step 200 ties checkpoint-200, the higher id wins) by step: ``final``, the newest save
    any writer made, is newest by no measure. ``keep_last 1`` rotates it, remote
    ``keep_last 1`` forgets it, ``latest()`` answers the copy of step 200.

    Safe: the same bytes written again at a path whose content is already recorded elsewhere
    (a copy) keep the content's first completion time; only a save that did not exist before
    (content back after a *different* version there) completes "now"."""
    from pipeline import api
    from pipeline.integrity import retention
    from pipeline.store.rotation import rotation_candidates

    settings = dataclasses.replace(db, remote_keep_last=1, keep_last=1)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w, ids = _run_with_final(settings, run)
    for again in (False, True):  # copied (and protected), then copied again over itself
        time.sleep(0.05)
        shutil.rmtree(run / "inspect", ignore_errors=True)
        shutil.copytree(run / "checkpoint-200", run / "inspect", copy_function=shutil.copyfile)
        time.sleep(0.05)
        w.scan()
        if not again:
            ids["inspect"] = _protect(settings, run / "inspect")
    wrong = []
    newest = api.latest(run, settings=settings)
    if newest is None or newest.id != ids["final"]:
        wrong.append(f"latest() answers {newest and newest.path}")
    with session_scope(settings.db_url) as s:
        verdicts = {v.checkpoint_id: v for v in retention.plan_run(s, settings, str(run))}
        if not verdicts[ids["final"]].keep:
            wrong.append(f"the remote policy forgets the final model: {verdicts[ids['final']].why}")
        if ids["final"] in rotation_candidates(s, str(run), settings.keep_last, settings.host_id):
            wrong.append("the local policy rotates the final model")
    assert not wrong, wrong


def test_a_resave_of_an_unknown_layout_that_cleared_the_folder_first_and_was_killed_does_not_release_the_protected_version(  # noqa: E501
        db, tmp_path):
    """History: a DeepSpeed-style folder ``global_step300/`` (two torch.save files, a layout
    the table does not know: complete once quiet) is saved, recorded and protected (v1). The
    job restarts, redoes step 300 and saves again into the same folder, clearing it first
    (``shutil.rmtree`` then ``makedirs``, as many save functions do); it is killed after the
    model states, before the optimizer states, between two scans of the watcher. No recorded
    file is left unchanged (the folder holds only the new model states), so the first round's
    rule (``resave_in_progress(by_quiet=True)``: some recorded files kept, others changed)
    does not fire: once quiet, the half save is recorded as v2, v1 is superseded and
    released, and after the collection's grace v1's content is garbage. v1 was the newest
    complete save; its local files are gone (the writer removed them), so it then exists
    nowhere.

    Safe: over a protected version, a folder that is complete only by the quiet rule and lost
    recorded files (a strict part of the recorded names) is not a new version by the quiet
    period alone (flagged "changed on disk, not protected"), or the version it replaces is
    not released until the new one is protected: v1's content is never garbage while nothing
    complete replaced it."""
    import torch

    from pipeline.integrity import gc
    from tests.checkpoints import state_dict
    from tests.unit.test_attack_i27 import DS_FILES, _deepspeed_like

    settings = dataclasses.replace(db, quiet_seconds=0.0, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    step = run / "global_step300"
    _deepspeed_like(step, seed=1, files=DS_FILES)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    v1 = _protect(settings, step)
    with session_scope(settings.db_url) as s:
        v1_shas = {sh.sha256 for f in s.get(Checkpoint, v1).files for sh in f.shards}
    time.sleep(0.02)
    # The restart's save: the folder cleared, then killed after its first file.
    shutil.rmtree(step)
    step.mkdir()
    torch.save(state_dict(seed=99, layers=2, width=32), step / DS_FILES[0])
    for _ in range(3):
        w.scan()
    with session_scope(settings.db_url) as s:
        lost = v1_shas & set(gc.garbage(s, settings))
        released = s.get(Checkpoint, v1).released_at
    assert not lost and released is None, (
        f"the protected version (the newest complete save) is released ({released}) and {len(lost)} of its "
        f"contents are garbage, replaced by a half save")


def test_a_checkpoint_restored_to_its_own_path_is_not_the_newest_save(db, tmp_path):
    """History: an HF run saves checkpoint-100, checkpoint-200, then the stepless final model
    ``final/``; all are protected. The Trainer's ``save_total_limit`` (or the user) deletes
    checkpoint-100: the watcher marks its local copy gone, it stays protected. The user brings
    it back where it was, to look at it or resume from it: ``ckpt restore <id> --to
    runs/r/checkpoint-100`` (restoring a checkpoint to its own path is allowed; emulated
    below by writing exactly its bytes there, with new file times as the actor's are). The
    watcher finds the same version at the same path, and ``catalog.record`` /
    ``_completed_again`` says it "completed now": ``latest()`` (and ``ckpt restore --latest``,
    the recovery point, the UI) now answer step 100, and a resume "from the latest" silently
    goes back past step 200 and the final model. A restore is not a save.

    Safe: the same bytes coming back at their own path while that version is still current
    (never superseded by other content there) keep their completion time; only content back
    after *another* version was at the path is a new save. ``latest()`` stays ``final``."""
    from pipeline import api

    settings = db
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w, ids = _run_with_final(settings, run)
    assert api.latest(run, settings=settings).id == ids["final"]
    kept = tmp_path / "bytes-of-100"
    shutil.copytree(run / "checkpoint-100", kept)
    shutil.rmtree(run / "checkpoint-100")  # the trainer's save_total_limit
    w.scan()
    time.sleep(0.05)
    shutil.copytree(kept, run / "checkpoint-100", copy_function=shutil.copyfile)  # the restore
    time.sleep(0.05)
    w.scan()
    newest = api.latest(run, settings=settings)
    assert newest is not None and newest.id == ids["final"], (
        f"latest() answers {newest and newest.path} (step {newest and newest.step}) after it was restored")


def test_a_dcp_resave_without_collectives_with_one_rank_done_is_not_a_new_version(db, tmp_path, sharded_dcp):
    """History: two ranks save FSDP2-sharded weights with ``dcp.save(...,
    use_collectives=False)`` into ``step_2/`` (each rank writes ``__<rank>_0.distcp`` then
    ``__<rank>.metadata``); it is recorded and protected (v1). The job restarts from an
    earlier step, redoes step 2 and saves again into the same folder: rank 0 rewrites its data
    and its ``__0.metadata``; rank 1 is killed (a node failure) before it writes anything.
    The folder is complete by the layout rule (every rank's metadata names files that are
    there; rank 1's old metadata covers the other half of every tensor), and the re-save rule
    (``layouts.resave_in_progress``) asks only that *one* of the files the writer writes last
    is new: ``__0.metadata`` is. So the mix (new rows 0-63, old rows 64-127 of every tensor)
    is recorded as v2, a checkpoint no writer made; v1 is superseded and released, and after
    the collection's grace its rank-0 half is garbage: the newest complete save is nowhere,
    and what a restore of step_2 gives loads without error but is half one step, half another.

    Safe: over a recorded version, a save without collectives is complete only once every
    rank's ``__<rank>.metadata`` is new (each rank writes its own last file); until then the
    folder is "changed on disk, not protected" and v1 stays current, kept and restorable."""
    from pipeline.integrity import gc

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    written = tmp_path / "written"
    written.mkdir()
    for seed in (1, 2):
        sharded_dcp(written / f"seed{seed}", seed=seed)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    step = run / "step_2"
    shutil.copytree(written / "seed1", step)
    w = Watcher(settings, [].extend, use_events=False)
    deadline = time.time() + 30
    while time.time() < deadline:
        w.scan()
        with session_scope(settings.db_url) as s:
            if s.scalar(select(Checkpoint.id).where(Checkpoint.path == str(step))) is not None:
                break
        time.sleep(0.1)
    v1 = _protect(settings, step)
    with session_scope(settings.db_url) as s:
        v1_shas = {sh.sha256 for f in s.get(Checkpoint, v1).files for sh in f.shards}
    time.sleep(0.05)
    # The restart's save: rank 0 done (data, then its metadata), rank 1 killed before writing.
    for name in ("__0_0.distcp", "__0.metadata"):
        shutil.copyfile(written / "seed2" / name, step / name)
    deadline = time.time() + max(3 * settings.settle_seconds, 1.0)
    while time.time() < deadline:
        w.scan()
        time.sleep(0.1)
    with session_scope(settings.db_url) as s:
        current = s.scalar(select(Checkpoint).where(Checkpoint.path == str(step), Checkpoint.current.is_(True)))
        lost = v1_shas & set(gc.garbage(s, settings))
        released = s.get(Checkpoint, v1).released_at
        assert current.id == v1 and released is None and not lost, (
            f"a re-save with one rank of two done was recorded as checkpoint {current.id}; the protected "
            f"version is released ({released}), {len(lost)} of its contents garbage")


def test_overwrite_through_a_symlinked_checkpoint_never_replaces_a_kept_version_with_other_content(db, tmp_path):
    """History: a run's newest save ``checkpoint-500`` is a symlinked folder that stays inside
    its root (``runs/r/checkpoint-500 -> runs/r/.saved/checkpoint-500``: a launcher that
    writes elsewhere and links; issue 27 says to follow it and record it under the path the
    user sees). checkpoint-300 and checkpoint-500 are protected. The user restores
    checkpoint-300 by id and types the newest folder as the target: ``ckpt restore <300>
    --to runs/r/checkpoint-500 --overwrite``. The first round's fix (``current.check_target``:
    never restore onto another kept version's path) compares the *resolved* target
    (``.saved/checkpoint-500``) with the recorded path (the link's), finds nothing, and the
    overwrite rules accept it (the files there are a protected checkpoint's). The actor writes
    step 300's bytes into the link's target; the watcher records them as checkpoint-500's
    new version: the real step 500 is superseded, released, and garbage once the
    collection's grace passes (the restore's write is emulated below exactly as the actor
    does it, into the resolved target; the decision that allows it and all after are real).

    Safe: the target is compared with recorded paths as the user sees them and resolved
    alike (a link's target is the link's checkpoint): the request is refused, as for a
    checkpoint that is not a link."""
    import os

    from pipeline.integrity import gc
    from pipeline.restoring import job as restore_job

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    run = tmp_path / "runs" / "r"
    (run / ".saved").mkdir(parents=True)
    w = Watcher(settings, [].extend, use_events=False)
    _trainer_checkpoint(run / "checkpoint-300", 300)
    time.sleep(0.05)
    w.scan()
    v300 = _protect(settings, run / "checkpoint-300")
    _trainer_checkpoint(run / ".saved" / "checkpoint-500", 500)
    os.symlink(run / ".saved" / "checkpoint-500", run / "checkpoint-500")
    time.sleep(0.05)
    w.scan()
    v500 = _protect(settings, run / "checkpoint-500")
    with session_scope(settings.db_url) as s:
        only_500 = ({sh.sha256 for f in s.get(Checkpoint, v500).files for sh in f.shards}
                    - {sh.sha256 for f in s.get(Checkpoint, v300).files for sh in f.shards})
        assert only_500
        try:
            _ckpt, target = restore_job.validate(s, settings, str(v300), str(run / "checkpoint-500"), overwrite=True)
        except Exception:
            return  # refused: safe
    # What the actor does once allowed: step 300's bytes in place of the resolved target.
    shutil.rmtree(target)
    shutil.copytree(run / "checkpoint-300", target, copy_function=shutil.copyfile)
    time.sleep(0.05)
    for _ in range(3):
        w.scan()
    with session_scope(settings.db_url) as s:
        lost = only_500 & set(gc.garbage(s, settings))
        released = s.get(Checkpoint, v500).released_at
    assert not lost and released is None, (
        f"restore of step 300 accepted over the symlinked newest save ({target}); checkpoint-500 released "
        f"({released}), {len(lost)} of its contents garbage")


def test_a_forgotten_multihost_step_keeps_another_hosts_parts_content_while_that_part_is_on_disk(db, tmp_path):
    """History: a DCP step saved from two hosts (node-a holds ``.metadata``, node-b holds
    ``__0_0.distcp``: one checkpoint, node-b's files a part) is protected. The remote policy
    forgets it; node-a's local policy then rotates its files (a forgotten checkpoint's local
    copy rotates like any other: pipeline/store/rotation.py), so the checkpoint's
    ``local_present`` is False. ``gc.kept_reference`` holds a forgotten checkpoint's content
    only while *the checkpoint's* local copy is there: node-b's part (still on node-b's disk,
    ``CheckpointPart.local_present``) no longer holds anything, so node-b's shards are
    garbage and the next collection deletes them from the workers. (node-a sends node-b its
    ``rotate_part`` right after; it is lost to this whenever node-b does not remove its part
    within the collection's grace: node-b away or rebooting, its part blocked as changed.) node-b's ``rotate_part``
    then asks the workers, finds fewer than RF copies, and is blocked for ever: node-b's part
    is never removed (the training disk fills, issue 27's "forgotten checkpoints are never
    rotated locally" back for multi-host steps), and the docstring's rule ("its content stays
    on the workers until it has [been rotated]") does not hold for a part.

    Safe: a forgotten checkpoint's content is held while *any* host still holds its local
    files (the checkpoint's own, or a part with ``local_present``), so each host's rotation
    finds RF copies, removes its files, and only then the collection takes the content."""
    from pipeline.db.models import CheckpointPart
    from pipeline.db.transitions import transition
    from pipeline.detection import catalog
    from pipeline.integrity import gc
    from tests.unit.test_parts import _announce_b, _split_step, _watcher

    settings = dataclasses.replace(db, gc_grace_seconds=0)
    (tmp_path / "runs" / "r").mkdir(parents=True)
    step, b_dir = _split_step(settings, tmp_path)
    _announce_b(settings, step, b_dir)
    assert _watcher(settings, "node-a").consider(step.parent, step) is None
    with session_scope(settings.db_url) as s:
        ckpt = s.scalar(select(Checkpoint))
        b_shas = {sh.sha256 for f in ckpt.files if f.host == "node-b" for sh in f.shards}
        assert b_shas
        job = catalog.latest_store_job(s, ckpt.id)
        for a, b in [("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified"),
                     ("verified", "forgotten")]:
            transition(s, job.id, "store", a, b)
    shutil.rmtree(step)  # node-a's local policy rotated its files of the forgotten step
    shutil.copytree(b_dir, step, copy_function=shutil.copy2)  # node-b's view of the path: its part
    with session_scope(settings.db_url) as s:
        s.scalar(select(Checkpoint)).local_present = False  # what rotate() writes for a forgotten one
    with session_scope(settings.db_url) as s:
        part = s.scalar(select(CheckpointPart).where(CheckpointPart.host == "node-b"))
        assert part is not None and part.local_present
        doomed = b_shas & set(gc.garbage(s, settings))
    assert not doomed, (f"{len(doomed)} of node-b's shards are garbage while node-b's part is still on its disk: "
                        "its rotate_part can never find RF copies again")


def test_after_ckpt_store_of_a_flagged_folder_a_new_change_is_flagged_again(db, tmp_path, monkeypatch):
    """History: a DeepSpeed-style folder ``global_step300/`` (a layout the table does not know)
    is recorded and protected (v1). A re-save rewrites the optimizer states and stops before
    the model states: the watcher flags the path, as the first round's rule says: "changed on
    disk, not protected ... `ckpt store PATH` records it as it is". The user judges the folder
    good and runs ``ckpt store PATH``: v2 is recorded, v1 superseded, the flag cleared in the
    database. The running watcher does not know: it still holds v1's signature
    (``Watcher.known``) and its own memory that the path is flagged with that reason
    (``DiskChanges.flagged``). The next re-save is killed the same way (the optimizer states
    rewritten again): the watcher computes the same reason text, finds it "already flagged"
    in memory and writes nothing. v2, the current version, is not flagged: ``ckpt status``,
    the UI and ``/metrics`` show a protected, unchanged checkpoint while its files on disk
    are bytes no replica has, until the watcher restarts. (A fresh watcher flags it: the
    control below.)

    Safe: a version recorded elsewhere (``ckpt store``) refreshes what the watcher compares
    with and what it believes it flagged (or the watcher reads the flag from the database):
    a change after ``ckpt store`` is flagged like any other."""
    import torch

    from pipeline import operations
    from tests.checkpoints import state_dict
    from tests.unit.test_attack_i27 import DS_FILES, _deepspeed_like

    monkeypatch.setattr(operations, "_send", lambda sends: None)
    settings = dataclasses.replace(db, quiet_seconds=0.0)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    step = run / "global_step300"
    _deepspeed_like(step, seed=1, files=DS_FILES)
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    v1 = _protect(settings, step)

    def killed_resave(seed: int) -> None:
        time.sleep(0.02)
        torch.save(state_dict(seed=seed, layers=2, width=32), step / DS_FILES[1])
        deadline = time.time() + max(settings.settle_seconds, 0.2) + 0.5
        while time.time() < deadline:
            w.scan()
            time.sleep(0.1)

    killed_resave(98)
    with session_scope(settings.db_url) as s:
        assert s.get(Checkpoint, v1).disk_changed, "the changed folder is flagged (the first round's rule)"
    done = operations.store(settings, str(step))
    v2 = _protect(settings, step)
    assert v2 == done.checkpoint_id != v1
    killed_resave(99)  # the same kind of change again, over v2
    with session_scope(settings.db_url) as s:
        flagged = s.get(Checkpoint, v2).disk_changed
    fresh = Watcher(settings, [].extend, use_events=False)
    fresh.reconcile()
    fresh.consider(run, step)
    with session_scope(settings.db_url) as s:
        assert s.get(Checkpoint, v2).disk_changed, "control: a fresh watcher flags it"
    assert flagged, "the running watcher left the changed current version unflagged (status: protected, unchanged)"


def test_a_rotated_checkpoint_restored_to_its_own_path_is_rotated_again_or_says_why(db, tmp_path):
    """History: ``keep_last 1``. checkpoint-100 is protected and rotated (verified copies on the
    workers, the local copy removed: store job ``rotated``). The user restores it where it was
    (``ckpt restore <id> --to runs/r/checkpoint-100``, allowed: its own path) to look at it;
    the watcher finds the same version back at its path: ``catalog.record`` sets
    ``local_present`` again but keeps the ``rotated`` job (only superseded, vanished and
    forgotten ones are stored again). Training goes on: checkpoint-200 and checkpoint-300. The
    local policy now wants checkpoint-100 gone, but ``rotation.plan_run`` sends nothing for it
    (``rotated`` is neither rotatable nor unfinished): the restored copy stays on the training
    disk for ever, counted by nothing, with no reason shown (the disk fills, silently).

    Safe: a local copy that is back is rotated again by the local policy (its copies are still
    verified on the workers), or the job says why it is not."""
    from pipeline.db.transitions import transition
    from pipeline.detection import catalog
    from pipeline.steps import Send
    from pipeline.store import rotation

    settings = dataclasses.replace(db, keep_last=1)
    run = tmp_path / "runs" / "r"
    run.mkdir()
    w = Watcher(settings, [].extend, use_events=False)
    _trainer_checkpoint(run / "checkpoint-100", 100)
    time.sleep(0.05)
    w.scan()
    v100 = _protect(settings, run / "checkpoint-100")
    kept = tmp_path / "bytes-of-100"
    shutil.copytree(run / "checkpoint-100", kept)
    # What rotate() leaves: the local copy gone, the job rotated.
    shutil.rmtree(run / "checkpoint-100")
    with session_scope(settings.db_url) as s:
        job = catalog.latest_store_job(s, v100)
        transition(s, job.id, "store", "verified", "rotated")
        s.get(Checkpoint, v100).local_present = False
    w.scan()
    time.sleep(0.05)
    shutil.copytree(kept, run / "checkpoint-100", copy_function=shutil.copyfile)  # the restore
    time.sleep(0.05)
    w.scan()
    for step in (200, 300):
        _trainer_checkpoint(run / f"checkpoint-{step}", step)
        time.sleep(0.05)
        w.scan()
        _protect(settings, run / f"checkpoint-{step}")
    with session_scope(settings.db_url) as s:
        assert s.get(Checkpoint, v100).local_present, "the restored copy is recorded as back"
        wanted = rotation.rotation_candidates(s, str(run), settings.keep_last, settings.host_id)
    assert v100 in wanted, "the local policy wants it gone"
    sends = rotation.plan_run(settings, str(run))
    with session_scope(settings.db_url) as s:
        job = catalog.latest_store_job(s, v100)
        state, reason = job.state, job.blocked_reason
    assert Send("rotate", (job.id,)) in sends or reason, (
        f"checkpoint-100's restored copy is never rotated and nothing says why (its job is {state})")
