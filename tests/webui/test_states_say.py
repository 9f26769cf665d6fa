"""States that mean what they say (issue 29): every view of a checkpoint, a run and the cluster's
capacity tells the same truth.

- A checkpoint forgotten by remote retention, its content collected, is grey "forgotten" in
  `ckpt status`, on its run's page and on its own page, never LOST or under-replicated; the
  health page and /metrics count no lost shard for it either.
- A checkpoint the trainer deleted before it was protected (vanished) is a warning on its run,
  not the red LOST banner.
- Three storage workers on one disk count it once (status, overview, /metrics); the usage chart
  is scaled to its data.
- Entries waiting to be recorded are listed with the time left.
"""
from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

from sqlalchemy import delete, select, update

from pipeline import capacity
from pipeline.db.engine import session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    Content,
    ContentCopy,
    Shard,
    StorageWorker,
)
from pipeline.db.transitions import now, transition
from pipeline.detection import catalog, completeness, roots, waits
from tests.checkpoints import atomic_save, state_dict
from tests.unit.test_status_view import status_text
from tests.webui.conftest import seed
from webui.charts import capacity_chart
from webui.data import health


def _forget_and_collect(s, ids: dict) -> None:
    """What remote retention, local rotation and garbage collection leave of a checkpoint: its
    store job forgotten, its local copy rotated, every copy of its content deleted."""
    with session_scope(s.db_url) as session:
        transition(session, ids["store_job"], "store", "verified", "forgotten", detail="remote retention policy")
        ckpt = session.get(Checkpoint, ids["checkpoint"])
        ckpt.local_present, ckpt.local_gone = False, "rotated"
        shas = list(session.scalars(select(Shard.sha256).join(CheckpointFile)
                                    .where(CheckpointFile.checkpoint_id == ckpt.id)))
        session.execute(delete(ContentCopy).where(ContentCopy.sha256.in_(shas)))
        session.execute(update(Content).where(Content.sha256.in_(shas)).values(state="deleted"))


def test_a_forgotten_collected_checkpoint_is_forgotten_in_every_view(client, web_settings, capsys):
    ids = seed(web_settings)
    _forget_and_collect(web_settings, ids)
    run = str(Path(ids["path"]).parent)

    out = status_text(web_settings, capsys)
    row = next(line for line in out.splitlines() if "step_1.safetensors" in line)
    assert " forgotten " in row and "rotated" in row, row
    assert "LOST" not in out and "under-replicated" not in out, out

    for page in (client.get("/runs", query_string={"name": run}), client.get(f"/checkpoints/{ids['checkpoint']}"),
                 client.get("/checkpoints")):
        html = page.get_data(as_text=True)
        assert page.status_code == 200 and 'class="health forgotten"' in html
        assert "health lost" not in html and "health under-replicated" not in html
    api = client.get(f"/api/checkpoints/{ids['checkpoint']}").get_json()
    assert api["health"] == "forgotten"
    assert health(web_settings)["shards"].get("lost", 0) == 0  # the health page and ckpt_shards agree
    metrics = client.get("/metrics").get_data(as_text=True)
    assert re.search(r'^ckpt_shards\{health="lost"\} 0\.0$', metrics, re.M), metrics


def _vanished(s) -> int:
    """A checkpoint recorded, then deleted (the trainer's save_total_limit) before it was protected."""
    path = atomic_save(state_dict(3), Path(s.roots[0].rstrip("*")) / "r1" / "step_3.safetensors")
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as session:
        ckpt, _job, _ = catalog.record(session, detected, lease_seconds=60, detail="seeded")
        path.unlink()
        catalog.mark_vanished(session, ckpt)  # what the watcher does when it finds it gone
        return ckpt.id


def test_a_checkpoint_deleted_before_it_was_protected_is_a_warning_on_its_run(client, web_settings, capsys):
    cid = _vanished(web_settings)
    run = web_settings.roots[0].rstrip("*") + "r1"

    out = status_text(web_settings, capsys)
    assert "LOST" not in out, out
    assert "warning: deleted before it was protected: 1 checkpoint(s)" in out
    row = next(line for line in out.splitlines() if "step_3.safetensors" in line)
    assert "vanished" in row and "unprotected" in row and "deleted by the trainer" in row, row

    html = client.get("/runs", query_string={"name": run}).get_data(as_text=True)
    warning = re.search(r'<p class="flash warn" id="vanished-warning">([^<]*)', html)
    assert warning and "deleted before it was protected: 1 checkpoint(s)" in warning.group(1)
    assert "health lost" not in html and 'class="flash error"' not in html
    page = client.get(f"/checkpoints/{cid}").get_data(as_text=True)
    assert "deleted by the trainer" in page and "health lost" not in page
    overview = client.get("/").get_data(as_text=True)
    assert 'class="flash warn" id="vanished-warning"' in overview and "LOST" not in overview


GB = 10**9


def _three_on_one_disk(s) -> None:
    """Three local storage workers on one 270 GB disk, as `ckpt up` runs them, each reporting the
    disk's free bytes as its own (and its own shards' bytes)."""
    with session_scope(s.db_url) as session:
        for i in range(3):
            session.add(StorageWorker(id=f"local-{i}", url=f"http://127.0.0.1:{7100 + i}", source="local",
                                      state="up", capacity_bytes=270 * GB, free_bytes=200 * GB, used_bytes=GB // 2,
                                      filesystem="boot-1:2049:123", fs_capacity_bytes=270 * GB,
                                      fs_free_bytes=200 * GB, last_seen=now()))


def test_workers_on_one_disk_count_it_once(client, web_settings, capsys):
    _three_on_one_disk(web_settings)
    with session_scope(web_settings.db_url) as session:
        u = capacity.usage(session, web_settings)
    assert (u.capacity, u.free, u.used, u.workers, u.filesystems) == (270 * 10**9, 200 * GB, 3 * GB // 2, 3, 1)
    # the watermark minus what others keep on the disk (70 GB less 1.5 GB of shards)
    assert u.limit == int(270 * GB * web_settings.high_watermark - (70 * GB - 3 * GB // 2))

    assert "used of 270.0 GB on 1 disk(s) of 3 worker(s)" in status_text(web_settings, capsys)
    assert re.search(r"^ckpt_cluster_capacity_bytes 2\.7e\+11$", client.get("/metrics").get_data(as_text=True),
                     re.M)
    assert "of 270.0 GB" in client.get("/").get_data(as_text=True)

    with session_scope(web_settings.db_url) as session:  # another host's disk is another disk
        session.add(StorageWorker(id="remote-0", url="http://127.0.0.1:7200", source="static", state="up",
                                  capacity_bytes=100 * GB, free_bytes=90 * GB, used_bytes=0,
                                  filesystem="boot-2:2049:123", fs_capacity_bytes=100 * GB, fs_free_bytes=90 * GB))
    with session_scope(web_settings.db_url) as session:
        assert capacity.usage(session, web_settings).capacity == 370 * GB


def test_the_usage_chart_is_scaled_to_its_data():
    t = now()
    used = [int(1.3e9 * (i + 1) / 4) for i in range(4)]  # growing to 1.3 GB on a 270 GB disk
    history = [{"at": t + timedelta(minutes=10 * i), "used": u, "stored": u, "capacity": 270 * GB}
               for i, u in enumerate(used)]
    svg = capacity_chart(history, limit=int(0.9 * 270 * GB))
    ys = [float(p.split(",")[1]) for p in re.search(r'class="line-used" fill="none" points="([^"]+)"', svg)
          .group(1).split()]
    assert max(ys) - min(ys) > 50, f"1.3 GB of growth is a curve, not a flat line: {ys}"
    assert "high watermark at 243.0 GB, far above this scale" in svg


def test_entries_waiting_to_be_recorded_are_listed_with_the_time_left(client, web_settings, capsys):
    seed(web_settings)  # the run has a checkpoint recorded (a run page lists recorded runs)
    run = web_settings.roots[0].rstrip("*") + "r1"
    t, host = now(), web_settings.host_id
    ago, ahead = (t - timedelta(seconds=20)).timestamp(), (t + timedelta(seconds=40)).timestamp()
    with session_scope(web_settings.db_url) as session:
        waits.record(session, host, f"{run}/step_9", run, "no known layout: complete once the folder stops changing",
                     1, ago, ahead)
        waits.record(session, host, f"{run}/checkpoint-8", run, "HF Trainer checkpoint without trainer_state.json "
                     "(the Trainer writes it last)", 1, (t - timedelta(seconds=30)).timestamp(), None)
    out = status_text(web_settings, capsys)
    assert re.search(r"step_9: recorded in (39|40) s if nothing changes: no known layout", out), out
    assert re.search(r"checkpoint-8: incomplete for (30|31) s: HF Trainer checkpoint", out), out
    for html in (client.get("/").get_data(as_text=True),
                 client.get("/runs", query_string={"name": run}).get_data(as_text=True)):
        assert 'id="waiting"' in html and "step_9" in html and "recorded in" in html and "incomplete for" in html
