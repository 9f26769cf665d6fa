"""The newest save written as shards and index into the run (db.newest.newest_protected, what
``latest()``, ``ckpt restore --latest`` and ``ckpt status`` answer), from outside: histories,
layouts and orders of events no test named that still answer a partial or older save, lose
the newest one, hang, or restore it other than as documented (docs/design.md, "The newest
save" and "7. The trainer's side"). Each test FAILS on main at ff7e6b0; its docstring gives the
history and the safe behaviour expected. (Written by the attack session; no pipeline code
changed; the restore tests were rewritten with the fix, for its one-at-a-time restores.)"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from pipeline import api, consumers, operations
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job
from pipeline.db.newest import newest_protected
from pipeline.db.transitions import transition
from pipeline.detection import catalog
from pipeline.detection.watcher import Watcher
from pipeline.errors import CkptError
from pipeline.hostid import host_queue

INDEX = "model.safetensors.index.json"
SHARDED = "200KB"  # tests/unit/test_layouts_resave.py: tiny_qwen saved this way is several shards
REPO = Path(__file__).resolve().parents[2]


# -- helpers ------------------------------------------------------------------------------------

def shard(k: int, n: int, stem: str = "model", ext: str = ".safetensors") -> str:
    return f"{stem}-{k:05d}-of-{n:05d}{ext}"


def _scan(settings) -> None:
    Watcher(settings, [].extend, use_events=False).scan()


def _verify(settings, path: Path, host: str | None = None) -> int:
    """The current version at ``path`` (on ``host``), its store job taken to verified."""
    with session_scope(settings.db_url) as s:
        q = select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True))
        if host is not None:
            q = q.where(Checkpoint.host == host)
        ckpt = s.scalar(q)
        assert ckpt is not None, f"{path} is not recorded"
        job = catalog.latest_store_job(s, ckpt.id)
        for a, b in [("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")]:
            transition(s, job.id, "store", a, b)
        return ckpt.id


def _verify_new(settings, run: Path, *, skip: tuple[str, ...] = ()) -> None:
    """Every current checkpoint of ``run`` still ``detected`` (except ``skip``), verified."""
    with session_scope(settings.db_url) as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.run == str(run), Checkpoint.current.is_(True))).all()
        for c in rows:
            job = catalog.latest_store_job(s, c.id)
            if c.name in skip or job.state != "detected":
                continue
            for a, b in [("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")]:
                transition(s, job.id, "store", a, b)


def _current_id(settings, path: Path, host: str | None = None) -> int:
    with session_scope(settings.db_url) as s:
        q = select(Checkpoint.id).where(Checkpoint.path == str(path), Checkpoint.current.is_(True))
        if host is not None:
            q = q.where(Checkpoint.host == host)
        return s.scalar(q)


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True, exist_ok=True)
    return run


def _at(path: Path, t_ns: int) -> None:
    os.utime(path, ns=(t_ns, t_ns))


def _write_sharded(run: Path, n: int, seed: int, t0: int, *, index: bool = True, rows: int = 16,
                   stem: str = "model") -> list[str]:
    """A sharded save as ``save_pretrained(run, max_shard_size=...)`` writes it: ``n`` shards,
    then the index naming them (written last), at times t0 + k * 0.1 s."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    weight_map, total, names = {}, 0, []
    for k in range(1, n + 1):
        name = shard(k, n, stem)
        arr = rng.standard_normal((rows, 8)).astype(np.float32)
        save_file({f"layer{k}.weight": arr}, str(run / name))
        _at(run / name, t0 + k * 10**8)
        weight_map[f"layer{k}.weight"] = name
        total += arr.nbytes
        names.append(name)
    if index:
        doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (run / f"{stem}.safetensors.index.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        _at(run / f"{stem}.safetensors.index.json", t0 + (n + 1) * 10**8)
    return names


def _write_file(path: Path, seed: int, t: int) -> Path:
    from safetensors.numpy import save_file

    save_file({"w": np.random.default_rng(seed).standard_normal((16, 8)).astype(np.float32)}, str(path))
    _at(path, t)
    return path


def _consumer(settings, host: str | None = None) -> None:
    """A Dramatiq worker of ``host`` (default this one) beats now: restores may be asked for."""
    host = host or settings.host_id
    with session_scope(settings.db_url) as s:
        consumers.beat(s, host, [host_queue(host)])


class _Hang(Exception):
    pass


NOW = time.time_ns() - 3600 * 10**9  # an hour ago: every file written below is settled


# -- which save is the newest ----------------------------------------------------------------

def test_a_resave_into_the_run_with_the_same_shard_count_is_latest_once_protected(db, tmp_path):
    """History: ``pretrained-2/``, then ``model.save_pretrained(run, max_shard_size=...)`` (the
    final model into the run: shards + index), all protected; training goes on (or the job is
    resumed) and the model is saved into the run again the same way: the same shard count, so
    the same shard names, and transformers writes the index byte for byte as before (its
    metadata and weight map depend only on the architecture and the shard size). The new
    shards are new versions; the index is the same content at the same path, so the catalog
    keeps its first completion time (catalog._completed_again). ``whole_save`` then finds the
    index's shard set written *after* the index and answers None: the group is passed over
    for ever, and latest()/status/`restore --latest` answer ``pretrained-2`` (the old shards
    are superseded). With a remote keep-last policy, pretrained-2 is then dropped too (the
    group is the newest by every measure): the run has no resume point at all.

    Safe: once every file of the second save is protected, latest() answers it: its index with
    the new shard versions as parts."""
    from tests.writers.write import tiny_qwen

    run = _run(tmp_path)
    tiny_qwen(0).save_pretrained(run / "pretrained-2")
    _scan(db)
    _verify_new(db, run)
    time.sleep(0.05)
    tiny_qwen(1).save_pretrained(run, max_shard_size=SHARDED)
    _scan(db)
    _verify_new(db, run)
    first = api.latest(run, settings=db)
    assert first is not None and first.path == str(run / INDEX) and first.parts, first
    index_bytes = (run / INDEX).read_bytes()

    time.sleep(0.05)
    tiny_qwen(2).save_pretrained(run, max_shard_size=SHARDED)  # trained further, saved again
    assert (run / INDEX).read_bytes() == index_bytes  # what transformers writes: the same index
    shards = sorted(p.name for p in run.iterdir() if p.name.startswith("model-"))
    _scan(db)
    _verify_new(db, run)
    with session_scope(db.db_url) as s:  # recorded: new shard versions, all protected
        now = {c.name: c.store_state for c in s.scalars(select(Checkpoint).where(
            Checkpoint.run == str(run), Checkpoint.current.is_(True)))}
    assert all(now[n] == "verified" for n in [*shards, INDEX]), now
    assert not {p.id for p in first.parts} & {_current_id(db, run / n) for n in shards}
    newest = api.latest(run, settings=db)
    assert newest is not None and newest.path == str(run / INDEX), \
        f"latest() answers {newest and newest.path}, not the second save into the run, protected whole"
    assert [p.id for p in newest.parts] == [_current_id(db, run / n) for n in shards]


def test_two_hosts_that_save_the_same_names_into_one_run_neither_hang_nor_mix(db, tmp_path, monkeypatch):
    """History: the same script runs on two training hosts (docs/design.md, "Hosts": two hosts
    may write the same path), each saving its model sharded into the run on its own disk:
    ``model-0000k-of-00003.safetensors`` + the index on h1 and on h2, each host's files a
    checkpoint of its own (same run, same names). h1's save is protected whole; h2's later one
    still stores its second shard. newest_protected collects the group's members into a dict
    by *name*, so one host's files hide the other's: it checks h2's files, passes over their
    ids, then finds h1's index (never passed over, since it was hidden) and checks h2's files
    again, for ever: latest(), `ckpt status`, the web UI and the alert sweep never return.
    (Had the dict kept a mix, it would answer one host's index with the other's shards.)

    Safe: newest_protected returns, with one host's save: here h1's whole save (the index and
    its three shards, all h1's)."""
    run = _run(tmp_path)
    h1, h2 = dataclasses.replace(db, host="h1"), dataclasses.replace(db, host="h2")
    names = _write_sharded(run, 3, seed=1, t0=NOW)
    _scan(h1)
    for name in [*names, INDEX]:
        _verify(h1, run / name, host="h1")
    # h2's disk: the same names, its own later save (another model size: another index).
    _write_sharded(run, 3, seed=2, t0=NOW + 10**10, rows=24)
    _scan(h2)
    for name in [names[0], names[2], INDEX]:
        _verify(h2, run / name, host="h2")  # its second shard still storing

    from pipeline.db import newest as newest_mod

    looked = []
    real = newest_mod.newest

    def counted(*args, **kwargs):  # each turn of newest_protected's loop looks up one checkpoint
        looked.append(1)
        if len(looked) > 100:
            raise _Hang("100 turns of newest_protected's loop over a run of 8 checkpoints")
        return real(*args, **kwargs)

    monkeypatch.setattr(newest_mod, "newest", counted)
    with session_scope(db.db_url) as s:
        try:
            found = newest_protected(s, str(run))
        except _Hang as exc:
            pytest.fail(f"newest_protected does not return (latest(), status and the UI hang): {exc}")
        assert found is not None
        ckpt, parts = found
        assert {c.host for c in (ckpt, *parts)} == {"h1"}, [(c.name, c.host) for c in (ckpt, *parts)]
        assert [c.name for c in (ckpt, *parts)] == [INDEX, *names]


def test_a_newer_checkpoint_beside_a_sharded_save_in_progress_is_not_passed_over(db, tmp_path):
    """History: S1, a sharded save into the run (2 shards + index), protected; then
    ``step_20.safetensors``, protected; then S2, the model saved into the run again with
    another shard count (another dtype or ``max_shard_size``): save_pretrained first deletes
    S1's shards (their names are not S2's), writes S2's three shards, and the node dies before
    the index (or: the node dies now, while S2 is being written; the moment a resume is
    needed). S2's shards are recorded and protected. newest_protected starts from the newest
    protected checkpoint, an S2 shard, and for its group answers the save the index completes:
    S1, older than step_20. latest() and `ckpt restore --latest` resume from S1 and lose
    step_20's progress.

    Safe: the newest save whole and protected is answered: step_20 (S1 completed before it)."""
    run = _run(tmp_path)
    s1 = _write_sharded(run, 2, seed=1, t0=NOW)
    _scan(db)
    _verify_new(db, run)
    step20 = _write_file(run / "step_20.safetensors", seed=5, t=NOW + 10 * 10**9)
    _scan(db)
    _verify_new(db, run)
    assert api.latest(run, settings=db).path == str(step20)
    for name in s1:  # save_pretrained's clean-up: shards of another count go first
        (run / name).unlink()
    _write_sharded(run, 3, seed=2, t0=NOW + 20 * 10**9, index=False)  # killed before its index
    _scan(db)
    _verify_new(db, run)
    newest = api.latest(run, settings=db)
    assert newest is not None and newest.path == str(step20), \
        f"latest() answers {newest and newest.path} ({newest and len(newest.parts)} parts), older than step_20"


def test_a_variant_save_into_the_run_is_not_answered_as_its_index_alone(db, tmp_path):
    """History: ``model.save_pretrained(run, max_shard_size=..., variant="fp16")`` (a documented
    transformers option: half-precision weights beside the full ones) writes
    ``model.fp16-0000k-of-0000N.safetensors`` and the index ``model.safetensors.index.fp16.json``
    into the run. save_group does not know the variant's index name (it ends ``.fp16.json``,
    not ``.index.json``): the index is a group of its own, the shards a group with no index.
    Every file protected, the newest protected checkpoint is the index, a group of one:
    latest() answers the JSON index alone, no shard as parts, and `ckpt restore --latest`
    gives back a folder holding only an index that names files it does not hold.

    Safe: latest() answers the whole save (the index and every shard it names), or, if the
    layout is not known, never a file that is only part of a save."""
    from tests.writers.write import tiny_qwen

    run = _run(tmp_path)
    tiny_qwen(0).save_pretrained(run / "pretrained-2")
    _scan(db)
    _verify_new(db, run)
    time.sleep(0.05)
    tiny_qwen(1).save_pretrained(run, max_shard_size=SHARDED, variant="fp16")
    files = sorted(p.name for p in run.iterdir() if p.is_file() and p.name != "config.json"
                   and p.name != "generation_config.json")
    assert "model.safetensors.index.fp16.json" in files and len(files) >= 3, files
    _scan(db)
    _verify_new(db, run)
    newest = api.latest(run, settings=db)
    assert newest is not None
    answered = sorted(Path(p.path).name for p in (newest, *newest.parts))
    assert answered in (files, ["pretrained-2"]), f"latest() answers {answered} of the save {files}"


# -- keeping what latest() answers ----------------------------------------------------------------

def _protected_single_then_partial_group(settings, run: Path) -> tuple[int, list[str]]:
    """``pretrained.safetensors`` protected; then a sharded save into the run whose shards are
    protected and whose index (written last) is recorded, still storing: latest() answers the
    save before it (as documented)."""
    first = _write_file(run / "pretrained.safetensors", seed=0, t=NOW)
    _scan(settings)
    fid = _verify(settings, first)
    names = _write_sharded(run, 3, seed=1, t0=NOW + 10 * 10**9)
    _scan(settings)
    _verify_new(settings, run, skip=(INDEX,))
    assert api.latest(run, settings=settings).id == fid
    return fid, names


def test_ckpt_forget_refuses_the_save_latest_answers_while_the_newer_one_is_not_whole(db, tmp_path):
    """History: ``pretrained.safetensors`` protected; a sharded save into the run, its shards
    protected, its index still storing (or never written: the node died). latest() answers
    ``pretrained.safetensors``: what a resume restores. ``ckpt forget`` refuses "the newest
    protected checkpoint of its run (what a resume restores)" by retention.newest_ids, which
    counts the group's shards as the newest save: it forgets pretrained.safetensors, and
    latest() has nothing left to answer (None).

    Safe: `ckpt forget` refuses the checkpoint latest() answers."""
    from pipeline.integrity.retention import forget

    run = _run(tmp_path)
    fid, _names = _protected_single_then_partial_group(db, run)
    with session_scope(db.db_url) as s:
        with pytest.raises(CkptError):
            forget(s, [str(fid)])
    assert api.latest(run, settings=db) is not None


def test_the_remote_policy_keeps_the_save_latest_answers_while_the_newer_one_is_not_whole(db, tmp_path):
    """History: remote keep-last 1. ``pretrained.safetensors`` protected; a sharded save into the
    run, its shards protected, its index still storing (a big index upload, a worker full) or
    never written (the trainer killed between its last shard and its index). The policy sweep
    keeps the newest by its measures, the shards (one save with the index), and forgets
    pretrained.safetensors: latest() answers None, and once the collection's grace passes the
    newest complete save exists nowhere.

    Safe: the policy never drops the save latest() answers (the newest save protected whole)."""
    from pipeline.integrity.retention import apply_policy

    settings = dataclasses.replace(db, remote_keep_last=1)
    run = _run(tmp_path)
    fid, _names = _protected_single_then_partial_group(settings, run)
    with session_scope(settings.db_url) as s:
        gone = apply_policy(s, settings)
    assert fid not in [v.checkpoint_id for v in gone], "the policy forgot the save latest() answers"
    assert api.latest(run, settings=settings) is not None


def test_status_says_protection_is_behind_while_the_newest_save_is_not_whole(db, tmp_path):
    """History: ``pretrained.safetensors`` protected; a sharded save into the run whose index
    (small, stored first) and later shards are protected while its first shard is not (stuck:
    a worker full, failing). status's recovery point (run_facts "protected") is now
    pretrained.safetensors, and ages; but "behind" and the run_unprotected alert look only at
    the newest *checkpoint*, the index, which is protected: no warning and no alert, however
    long the save stays partial.

    Safe: with lag_warning_seconds passed, the run says protection is behind (the newest save
    is not protected whole) and the run_unprotected alert fires."""
    from pipeline.alerts import _runs_unprotected
    from pipeline.status import run_summaries

    settings = dataclasses.replace(db, lag_warning_seconds=0.0)
    run = _run(tmp_path)
    _write_file(run / "pretrained.safetensors", seed=0, t=NOW)
    _scan(settings)
    _verify_new(settings, run)
    names = _write_sharded(run, 3, seed=1, t0=NOW + 10 * 10**9)
    _scan(settings)
    _verify_new(settings, run, skip=(names[0],))
    with session_scope(settings.db_url) as s:
        (summary,) = run_summaries(s, settings)
        alerts = _runs_unprotected(s, settings, None)
    assert summary["protected_name"] == "pretrained.safetensors"
    assert summary["behind"] is not None, summary
    assert [c for c in alerts if c.subject == str(run)], alerts


# -- restoring it ------------------------------------------------------------------------------

def _latest_save(settings, tmp_path: Path, monkeypatch) -> tuple[Path, api.Protected]:
    run = _run(tmp_path)
    _write_sharded(run, 3, seed=1, t0=NOW)
    _scan(settings)
    _verify_new(settings, run)
    _consumer(settings)
    monkeypatch.chdir(tmp_path)
    newest = api.latest(run, settings=settings)
    assert newest is not None and len(newest.parts) == 3
    return run, newest


def _wanted(newest: api.Protected, folder: Path) -> list[tuple[str, str]]:
    return [(str(p.id), str(folder / Path(p.path).name)) for p in (*newest.parts, newest)]


def _restore_jobs(settings) -> list[Job]:
    with session_scope(settings.db_url) as s:
        jobs = s.scalars(select(Job).where(Job.kind == "restore").order_by(Job.id)).all()
        for j in jobs:
            s.expunge(j)
        return list(jobs)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"host": None, "wait": True, "timeout": 5.0, "overwrite": False, **kw})


def test_restore_jobs_waiting_their_turn_in_the_caller_are_not_redriven_before_it(db, tmp_path, monkeypatch):
    """History: ``ckpt restore --latest RUN --to DIR --wait`` (or ``restore(latest(run))``) of a
    save of big shards. Recorded all at once, each with a lease of lease_seconds (60), to be run
    one after the other in the caller, the index last, the jobs after the first shard waited
    past their lease, and the scheduler's re-drive sent them, the index's too, to the host's
    Dramatiq worker: the index landed before the shards ahead of it.

    Safe: a job is recorded only when its turn comes (the previous file is restored): none
    waits, none can be re-driven early; every file is checked before the first is recorded."""
    from pipeline.cli import main

    _run_, newest = _latest_save(db, tmp_path, monkeypatch)
    wanted = _wanted(newest, tmp_path / "resumed")
    operations.check_restores(db, wanted, from_here=True)
    assert _restore_jobs(db) == [], "checking recorded a job"
    seen: list[int] = []

    def here(settings, job_id, watch=None):  # each turn: the jobs recorded so far
        seen.append(len(_restore_jobs(settings)))
        return True

    monkeypatch.setattr(operations, "restore_here", here)
    monkeypatch.setattr(main, "wait_job", lambda *a, **k: 0)
    assert main._restoring(_args(), db, True, wanted) == 0
    assert seen == list(range(1, len(wanted) + 1)), seen
    assert [j.checkpoint_id for j in _restore_jobs(db)] == [int(ref) for ref, _dest in wanted]
    assert _restore_jobs(db)[-1].checkpoint_id == newest.id  # the index last


def test_ctrl_c_during_restore_latest_leaves_no_job_to_run_later(db, tmp_path, monkeypatch):
    """History: ``ckpt restore --latest RUN --to DIR --wait`` of a sharded save; the user presses
    Ctrl-C during the first shard. The jobs after it were recorded and stayed ``queued``: the
    scheduler re-drove them once their lease ended, with nobody waiting.

    Safe: the interrupted file's job is the only one recorded (handed to the host's worker, as
    any interrupted restore); nothing else runs later."""
    from pipeline.cli import main

    _run_, newest = _latest_save(db, tmp_path, monkeypatch)
    wanted = _wanted(newest, tmp_path / "resumed")
    operations.check_restores(db, wanted, from_here=True)

    def interrupted(settings, job_id, watch=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(operations, "restore_here", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main._restoring(_args(), db, True, wanted)
    assert [j.checkpoint_id for j in _restore_jobs(db)] == [int(wanted[0][0])]


def test_restore_latest_on_another_host_with_wait_writes_the_index_last(db, tmp_path, monkeypatch):
    """History: ``ckpt restore --latest RUN --to /scratch/resume --host h2 --wait``: every
    file's restore message was sent at once, h2's worker restored them side by side.

    Safe: waited for, each file's job is recorded and sent once the one before it is done on
    h2: the index's last."""
    from pipeline.cli import main

    _run_, newest = _latest_save(db, tmp_path, monkeypatch)
    _consumer(db, "h2")
    wanted = _wanted(newest, Path("/scratch/resume"))
    operations.check_restores(db, wanted, host="h2")
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(operations, "_send", lambda sends: events.extend(("sent", s.args[0]) for s in sends) or True)
    monkeypatch.setattr(main, "wait_job", lambda s, job_id, **k: events.append(("done", job_id)) or 0)
    assert main._restoring(_args(host="h2"), db, False, wanted) == 0
    jobs = [j.id for j in _restore_jobs(db)]
    assert events == [e for j in jobs for e in (("sent", j), ("done", j))], events


def test_restore_latest_into_a_new_folder_as_for_a_folder_checkpoint(db, tmp_path, monkeypatch):
    """History: a resume script runs ``ckpt restore --latest RUN --to /scratch/resume --wait``,
    which works while the newest save is a folder (the folder is created) or one file. Once the
    newest save is the final model written sharded into the run, the same command was refused
    ("... is not a directory; create it first").

    Safe: a sharded save restores into a folder that does not exist yet (created, as for a
    folder checkpoint); a file there is refused, and nothing is recorded."""
    _run_, newest = _latest_save(db, tmp_path, monkeypatch)
    try:
        operations.check_restores(db, _wanted(newest, tmp_path / "resume"), from_here=True)
    except CkptError as exc:
        pytest.fail(f"refused: {exc}")
    assert (tmp_path / "resume").is_dir() and _restore_jobs(db) == []
    fresh = tmp_path / "fresh"  # a refusal after the folder was made (an unknown checkpoint) takes it away
    with pytest.raises(CkptError):
        operations.check_restores(db, [(str(newest.id), str(fresh / "a")), ("987654", str(fresh / "b"))],
                                  from_here=True)
    assert not fresh.exists()
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(CkptError, match="is a file"):
        operations.check_restores(db, _wanted(newest, tmp_path / "afile"), from_here=True)


# -- the rename -------------------------------------------------------------------------------

def test_the_package_listings_name_pipeline_restoring():
    """History: pipeline/restore/ was renamed pipeline/restoring/. docs/design.md section 1
    ("lists every module") and README.md's Layout still list ``restore/`` and no
    ``restoring/``: a reader looking for the restore job code is sent to a package that does
    not exist.

    Safe: both listings name ``restoring/`` and no ``restore/``."""
    for doc in ("docs/design.md", "README.md"):
        text = (REPO / doc).read_text()
        listed = set(re.findall(r"^\s+([a-z_]+)/\s", text, flags=re.M))
        assert "restoring" in listed and "restore" not in listed, (doc, sorted(listed))
