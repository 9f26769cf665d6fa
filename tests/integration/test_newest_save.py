"""The newest save is never lost (issue 27, rows 1, 2 and 8), with the real writers and the real
cluster.

"Newest" is the most recently completed save (docs/design.md, "The newest save"), not the
highest digits in a name:

- HF ``trainer.save_model()`` after ``checkpoint-2/4/6`` writes ``model.safetensors`` into
  the run (no step in its name); a folder ``epoch-1`` written after the checkpoints has none
  either. Under local keep-last 1 and a remote keep-last 1, each stays on the training disk
  and restorable, and ``ckpt restore --latest`` names it.
- Lightning ``ModelCheckpoint(save_top_k=2, save_last=True)`` on a metric that stops
  improving: ``last.ckpt`` (step 10) is what ``--latest`` restores, not step 4.
- Remote keep-last 1 with local keep-last 2: forgotten checkpoints are rotated off the
  training disk by the local policy (while their copies exist), then collected.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Content, Job, Shard
from pipeline.detection.catalog import latest_store_job
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for
from tests.writers import forked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def write(cluster, writer: str, run: Path) -> list[Path]:
    r = forked.run([sys.executable, "-m", "tests.writers.write", writer, str(run)], cwd=REPO,
                   env={**cluster.env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return [Path(p) for p in json.loads(r.stdout.strip().splitlines()[-1])["saves"]]


def states(cluster, run: Path) -> dict[str, tuple[str, bool]]:
    """name -> (state, local copy present) of the run's current checkpoints."""
    with session_scope(cluster.settings.db_url) as s:
        out = {}
        for c in s.scalars(select(Checkpoint).where(Checkpoint.run == str(run.resolve()),
                                                    Checkpoint.current.is_(True))):
            job = latest_store_job(s, c.id)
            out[c.name] = (job.state if job else "?", c.local_present)
        return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("writer,newest", [("hf_trainer_final", "model.safetensors"), ("hf_trainer_epoch", "epoch-1")])
def test_a_final_save_without_a_step_is_the_newest_and_never_dropped(make_cluster, tmp_path, writer, newest):
    cluster = make_cluster(env={"CKPT_KEEP_LAST": "1", "CKPT_REMOTE_KEEP_LAST": "1", "CKPT_GC_GRACE_SECONDS": "0"})
    run = cluster.runs / "hf"
    saves = write(cluster, writer, run)
    assert saves[-1].name == newest
    for p in saves:
        checkpoint_job(cluster, p)
    # The older checkpoints leave the disk and the workers' keep; the final save and the
    # newest by step (checkpoint-6: when in doubt, keep) stay on disk and restorable.
    wanted = {"checkpoint-2": ("forgotten", False), "checkpoint-4": ("forgotten", False),
              "checkpoint-6": ("verified", True), newest: ("verified", True)}
    wait_for(lambda: states(cluster, run) == wanted or None, 120, f"the policies to settle: {wanted}")
    r = cluster.cli("gc", "--wait", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert states(cluster, run) == wanted
    assert saves[-1].exists()

    (tmp_path / "resumed").mkdir()
    dest = tmp_path / "resumed" / newest
    r = cluster.cli("restore", "--latest", str(run), "--to", str(dest), "--wait", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"newest protected checkpoint of {run}: {saves[-1].resolve()}" in r.stdout
    if saves[-1].is_dir():
        assert {p.name: sha(p) for p in dest.iterdir()} == {p.name: sha(p) for p in saves[-1].iterdir()}
    else:
        assert sha(dest) == sha(saves[-1])
    doc = json.loads(cluster.cli("status", "--json").stdout)
    (summary,) = [r for r in doc["runs"] if r["run"] == str(run.resolve())]
    assert summary["newest_name"] == summary["protected_name"] == newest


def test_lightning_last_ckpt_is_what_latest_restores(make_cluster, tmp_path):
    cluster = make_cluster(env={"CKPT_KEEP_LAST": "5"})
    run = cluster.runs / "lightning"
    saves = write(cluster, "lightning_last", run)
    assert sorted(p.name for p in saves) == ["last.ckpt", "step_step=2.ckpt", "step_step=4.ckpt"]
    last = run / "last.ckpt"
    for p in saves:
        checkpoint_job(cluster, p)

    def protected_last() -> bool:
        with session_scope(cluster.settings.db_url) as s:
            c = s.scalar(select(Checkpoint).where(Checkpoint.path == str(last.resolve()),
                                                  Checkpoint.current.is_(True)))
            if c is None:
                return False
            files = {f.relpath: f.sha256 for f in c.files}
            return files == {"": sha(last)} and latest_store_job(s, c.id).state == "verified"

    wait_for(protected_last, 120, "the final last.ckpt to be protected")
    for p in saves:
        cluster.wait_job(checkpoint_job(cluster, p), ("verified",), timeout=120)
    dest = tmp_path / "resume.ckpt"
    r = cluster.cli("restore", "--latest", str(run), "--to", str(dest), "--wait", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{last.resolve()}" in r.stdout.splitlines()[0], r.stdout
    assert sha(dest) == sha(last)
    import torch

    assert torch.load(dest, weights_only=False, map_location="cpu")["global_step"] == 10


def test_latest_of_a_sharded_save_into_the_run_restores_every_file_of_it(make_cluster, tmp_path):
    """``save_pretrained(run, max_shard_size=...)`` after ``pretrained-2``: the newest save is
    its shards and index, each a checkpoint. ``ckpt restore --latest`` and
    ``restore(latest(run))`` give every file of it back into the folder named (the index last),
    not the index alone."""
    cluster = make_cluster()
    run = cluster.runs / "hf"
    saves = write(cluster, "save_pretrained_into_run", run)
    folder, *files = saves
    assert folder.name == "pretrained-2" and files[-1].name == "model.safetensors.index.json" and len(files) >= 4
    for p in saves:  # pretrained-2 may rotate the moment it is verified (the newer save is protected)
        cluster.wait_job(checkpoint_job(cluster, p), ("verified", "rotated") if p == folder else ("verified",),
                         timeout=120)
    index = json.loads(files[-1].read_text())
    assert set(index["weight_map"].values()) == {p.name for p in files[:-1]}

    afile = tmp_path / "model.safetensors"  # --to as for one file: refused before any job is recorded
    afile.write_bytes(b"x")
    r = cluster.cli("restore", "--latest", str(run), "--to", str(afile), "--wait", timeout=180)
    assert r.returncode != 0 and f"{afile} is a file: the {len(files)} files of this save go back into a folder" \
        in r.stderr, r.stdout + r.stderr
    with session_scope(cluster.settings.db_url) as s:
        assert not s.scalars(select(Job).where(Job.kind == "restore")).all()

    dest = tmp_path / "resumed"
    dest.mkdir()
    r = cluster.cli("restore", "--latest", str(run), "--to", str(dest), "--wait", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"newest protected save of {run}: {files[-1].resolve()} and its {len(files) - 1} shards" in r.stdout
    assert {p.name: sha(p) for p in dest.iterdir()} == {p.name: sha(p) for p in files}
    jobs = [line for line in r.stdout.splitlines() if line.startswith("restore job ")]
    assert len(jobs) == len(files) and jobs[-1].endswith(f"-> {dest.resolve() / files[-1].name} "
                                                         f"on host {cluster.settings.host_id}"), r.stdout

    code = ("import sys, pipeline; p = pipeline.latest(sys.argv[1]); "
            "print(pipeline.restore(p, to=sys.argv[2]), len(p.parts))")
    again = tmp_path / "again"
    again.mkdir()
    r = subprocess.run([sys.executable, "-c", code, str(run), str(again)], cwd=REPO, env=cluster.env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split() == [str(again.resolve()), str(len(files) - 1)]
    assert {p.name: sha(p) for p in again.iterdir()} == {p.name: sha(p) for p in files}
    from safetensors.torch import load_file

    for name in set(index["weight_map"].values()):
        restored, written = load_file(again / name), load_file(run / name)
        assert restored.keys() == written.keys() and all((restored[k] == written[k]).all() for k in written)


def test_remote_keep_last_1_with_local_keep_last_2_rotates_forgotten_checkpoints(make_cluster):
    """Forgotten checkpoints do not stay on the training disk for ever: the local policy rotates
    them (only while the workers hold their copies), then the collection frees them."""
    cluster = make_cluster(env={"CKPT_KEEP_LAST": "2", "CKPT_REMOTE_KEEP_LAST": "1", "CKPT_GC_GRACE_SECONDS": "0"})
    run = cluster.runs / "run"
    run.mkdir()
    paths = []
    for step in range(1, 5):
        paths.append(atomic_save(state_dict(step), run / f"step_{step}.safetensors"))
        cluster.wait_job(checkpoint_job(cluster, paths[-1]), ("verified", "rotated", "forgotten"), timeout=90)
        if step == 2:  # the remote policy forgets step 1 while the local policy still keeps it
            wait_for(lambda: states(cluster, run).get("step_1.safetensors") == ("forgotten", True) or None, 60,
                     "step 1 forgotten, its local copy kept")
    wanted = {"step_1.safetensors": ("forgotten", False), "step_2.safetensors": ("forgotten", False),
              "step_3.safetensors": ("forgotten", True), "step_4.safetensors": ("verified", True)}
    wait_for(lambda: states(cluster, run) == wanted or None, 90, f"rotation of the forgotten: {wanted}")
    assert [p.exists() for p in paths] == [False, False, True, True]

    r = cluster.cli("gc", "--wait", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    with session_scope(cluster.settings.db_url) as s:
        on_disk = select(Shard.sha256).join(CheckpointFile).join(Checkpoint).where(
            Checkpoint.path.in_([str(p.resolve()) for p in paths[2:]]))
        held = sum(s.scalars(select(Content.size).where(Content.sha256.in_(on_disk))))
        live = sum(s.scalars(select(Content.size).where(Content.state == "live")))
    # What the workers keep is exactly what the two checkpoints on disk reference: step 3's
    # copies stay while its local copy does (its rotation will need them).
    assert live == held
    disk = sum(p.stat().st_size for w in cluster.workers for p in (w.data / "shards").rglob("*") if p.is_file())
    assert disk == cluster.settings.rf * held
