"""Issue 27, from outside, second round: histories no test named that still lose or hide the
newest save after the first attack round's fixes (tests/unit/test_attack_i27.py). Each test
documents a defect found at fa6e7f3 and FAILS there; its docstring gives the history and the
safe behaviour expected. (Written by the second attack session; no pipeline code changed.)"""
from __future__ import annotations

import dataclasses
import shutil
import time

from pipeline.db.engine import session_scope
from pipeline.detection.watcher import Watcher
from tests.unit.test_attack_i27 import _protect, _trainer_checkpoint


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
    from tests.writers.write import tiny_qwen

    settings = dataclasses.replace(db, remote_keep_last=1, keep_last=1)
    run = tmp_path / "runs" / "r"
    run.mkdir()
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
