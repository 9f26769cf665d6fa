"""The writer matrix: checkpoints saved by the libraries people train with, on a slow disk.

Given a cluster watching a run per writer, When each real writer (transformers
save_pretrained single and sharded, the HF Trainer, accelerate, Lightning, torch DCP with 2
and 4 gloo ranks, torch.save and safetensors written in place) saves with a 1.5 s pause
before every weights file and a pause inside every file, Then every save is exactly one
protected version, no partial version was ever verified, and each restores byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job, JobEvent
from pipeline.detection.catalog import latest_store_job, version_of
from tests.checkpoints import files_of
from tests.processes import Cluster, wait_for
from tests.writers import forked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
WRITERS = ["save_pretrained", "save_pretrained_sharded", "hf_trainer", "accelerate", "lightning", "dcp2", "dcp4",
           "torch_save", "safetensors"]
#: A pause before each weights file (gathering a multi-GB shard) and one inside every file.
SLOW = {"CKPT_SLOW_BEFORE": "1.5", "CKPT_SLOW_INSIDE": "0.7"}


def disk_version(path: Path) -> str:
    """The version id of what is on the disk at ``path`` (as detection computes it)."""
    files = [("", path)] if path.is_file() else [(str(p.relative_to(path)), p) for p in sorted(path.rglob("*"))
                                                 if p.is_file()]
    return version_of((rel, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for rel, p in files)


def newest_write(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return max(p.stat().st_mtime for p in files)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every writer run at once (their pauses overlap) against one cluster; the saves they made."""
    c = Cluster(tmp_path_factory.mktemp("writers"), env={"CKPT_KEEP_LAST": "100"})
    c.start()
    try:
        env = {**c.env, **SLOW, "CKPT_SLOW_ROOT": str(c.runs), "PYTHONPATH": str(REPO)}
        procs = {w: forked.popen([sys.executable, "-m", "tests.writers.write", w, str(c.runs / w)], cwd=REPO,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for w in WRITERS}
        saves = {}
        for w, p in procs.items():
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, f"{w} failed:\n{err[-3000:]}"
            saves[w] = [Path(s) for s in json.loads(out.strip().splitlines()[-1])["saves"]]
        yield c, saves
    finally:
        c.stop()


def wait_protected(c: Cluster, path: Path, timeout: float = 120) -> Checkpoint:
    """The current version at ``path`` once it holds what the disk holds and is verified."""
    want = disk_version(path)

    def done() -> Checkpoint | None:
        with session_scope(c.settings.db_url) as s:
            ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
            if ckpt is None or ckpt.version != want:
                return None
            job = latest_store_job(s, ckpt.id)
            assert job is not None and job.state not in ("failed", "superseded", "vanished"), (path, job.state,
                                                                                                job.last_error)
            return ckpt if job.state in states.PROTECTED else None

    return wait_for(done, timeout, f"{path} protected as the writer left it", interval=0.25)


@pytest.mark.parametrize("writer", WRITERS)
def test_every_save_is_one_protected_version_and_nothing_partial_was_verified(matrix, writer, tmp_path):
    c, saves = matrix
    report = {}
    for path in saves[writer]:
        final = wait_protected(c, path)
        with session_scope(c.settings.db_url) as s:
            versions = s.scalars(select(Checkpoint).where(Checkpoint.path == str(path)).order_by(Checkpoint.id)).all()
            protected = [v for v in versions if latest_store_job(s, v.id).state in states.PROTECTED]
            partial_verified = [v.id for v in versions if v.id != final.id and s.scalar(
                select(JobEvent.id).join(Job, Job.id == JobEvent.job_id)
                .where(Job.checkpoint_id == v.id, JobEvent.to_state == "verified").limit(1)) is not None]
            report[path.name] = {"rows": len(versions), "layout": final.layout,
                                 "latency_s": (final.detected_at.timestamp() - newest_write(path))}
        assert [v.id for v in protected] == [final.id], f"{path}: {len(protected)} protected versions"
        assert not partial_verified, f"{path}: partial versions {partial_verified} were verified"
        dest = tmp_path / path.name
        r = c.cli("restore", str(path), "--to", str(dest), "--wait", timeout=120)
        assert r.returncode == 0, r.stderr
        assert files_of(dest) == files_of(path), f"{path} did not restore byte for byte"
    out = REPO / ".pytest_cache" / "writer-matrix"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{writer}.json").write_text(json.dumps({"saves": len(saves[writer]), "checkpoints": report}, indent=1))


def test_the_matrix_table(matrix):
    """Prints rows recorded against saves made and the detection latency per layout (p50)."""
    c, saves = matrix
    for w in WRITERS:
        for path in saves[w]:
            wait_protected(c, path)
    with session_scope(c.settings.db_url) as s:
        lines = [f"{'writer':<26} {'saves':>5} {'rows':>5} {'protected':>9}  layout"]
        latency: dict[str, list[float]] = {}
        for w in WRITERS:
            rows = s.scalars(select(Checkpoint).where(Checkpoint.run == str(c.runs / w))).all()
            prot = sum(1 for r in rows if latest_store_job(s, r.id).state in states.PROTECTED)
            layouts = sorted({r.layout or "-" for r in rows if r.current})
            for r in rows:
                if r.current:
                    lag = r.detected_at.timestamp() - newest_write(Path(r.path))
                    latency.setdefault(r.layout or "-", []).append(lag)
            lines.append(f"{w:<26} {len(saves[w]):>5} {len(rows):>5} {prot:>9}  {', '.join(layouts)}")
            assert prot == len(saves[w])
    lines.append("detection latency (last byte written -> detected), p50 per layout: " + ", ".join(
        f"{k} {statistics.median(v):.2f} s" for k, v in sorted(latency.items())))
    text = "\n".join(lines)
    print("\n" + text)
    (REPO / ".pytest_cache").mkdir(exist_ok=True)
    (REPO / ".pytest_cache" / "writer-matrix.txt").write_text(text + "\n")
