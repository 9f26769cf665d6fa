"""The control plane after months: ``ckpt status`` and every UI page at 100k checkpoints and 1M
job events.

A SQLite control plane (the default) is filled the way months of training fill it: 10 runs of
10,000 checkpoints, each a file of 4 shards of which 3 are the previous step's content (so
contents and copies number like a real run's), most of them forgotten or rotated, every store
job with its timeline (10 events each: 1M in all), 3 storage workers and an object-store
target holding one verified copy of every live content (the tier of ``[[targets]]``), and a
year of capacity samples; then the scheduler's ``PRAGMA optimize`` (pipeline.db.engine.optimize), so the planner
has the statistics it has in service. Then each read is timed, best of 3, in this process (the
pages through Flask's test client, the real app) and ``ckpt status`` as the separate process a
user runs.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import insert

from pipeline import settings as settings_mod
from pipeline.db.engine import get_engine, optimize
from pipeline.db.migrate import upgrade
from pipeline.db.models import (
    CapacitySample,
    Checkpoint,
    CheckpointFile,
    Content,
    ContentCopy,
    Job,
    JobEvent,
    Shard,
    StorageWorker,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STORE_PATH = ("detected", "sharded", "replicated", "verified", "rotated")


def fill(url: str, runs: int = 10, per_run: int = 10_000, events_per_job: int = 10) -> dict:
    started = time.monotonic()
    engine = get_engine(url)
    n = runs * per_run
    sha = lambda k: f"{k:064x}"  # noqa: E731
    with engine.begin() as conn:
        conn.execute(insert(StorageWorker), [
            {"id": f"w{i}", "url": f"http://127.0.0.1:{7000 + i}", "zone": "", "source": "static", "state": "up",
             "capacity_bytes": 4 * 10**12, "free_bytes": 3 * 10**12, "used_bytes": 10**12,
             "last_seen": T0 + timedelta(days=200)} for i in range(3)])
        conn.execute(insert(StorageWorker), [
            {"id": "target:store", "url": "s3://ckpts/lab", "zone": "objectstore:store", "source": "target",
             "tier": "objectstore", "state": "up", "capacity_bytes": 0, "free_bytes": 0, "used_bytes": 0,
             "last_seen": T0 + timedelta(days=200)}])
        contents, copies, ckpts, files, shards, jobs, events = [], [], [], [], [], [], []
        content_id = 0
        for r in range(runs):
            window = [content_id + k for k in range(4)]
            content_id += 4
            for i in range(per_run):
                cid = r * per_run + i + 1
                if i:  # one of the four shards changes per step
                    window[i % 4] = content_id
                    content_id += 1
                at = T0 + timedelta(minutes=30 * i)
                newest = i >= per_run - 5
                state = "verified" if newest else ("rotated" if i % 97 == 0 else "forgotten")
                ckpts.append({"id": cid, "path": f"/data/runs/r{r}/checkpoint-{i * 100}", "run": f"/data/runs/r{r}",
                              "name": f"checkpoint-{i * 100}", "is_dir": True, "version": f"{cid:016x}",
                              "step": i * 100, "mtime": at.timestamp(), "total_bytes": 4 * 2**26,
                              "local_present": newest, "detected_at": at, "current": True,
                              "released_at": None if state != "forgotten" else at + timedelta(days=2),
                              "pinned": False, "metrics": {"eval_loss": 1.0 / (i + 1)}, "store_state": state})
                files.append({"id": cid, "checkpoint_id": cid, "relpath": "model.safetensors", "size": 4 * 2**26,
                              "sha256": sha(10**9 + cid), "format": "safetensors",
                              "mtime_ns": int(at.timestamp() * 1e9)})
                for seq, k in enumerate(window):
                    shards.append({"file_id": cid, "seq": seq, "kind": "safetensors", "sha256": sha(k), "size": 2**26,
                                   "src_offset": seq * 2**26, "length": 2**26, "payload_offset": 0, "tensors": None})
                jobs.append({"id": cid, "kind": "store", "checkpoint_id": cid, "state": state, "attempts": 0,
                             "params": {}, "bytes_done": 4 * 2**26, "bytes_total": 4 * 2**26, "created_at": at,
                             "updated_at": at, "finished_at": at + timedelta(minutes=3)})
                path = [*STORE_PATH[:4], "forgotten" if state == "forgotten" else STORE_PATH[4]]
                for e in range(events_per_job):  # the transitions, then notes (progress) in the last state
                    b = path[min(e, len(path) - 1)]
                    a = None if e == 0 else path[e - 1] if e < len(path) else b
                    events.append({"job_id": cid, "at": at + timedelta(seconds=e), "from_state": a, "to_state": b,
                                   "detail": "benchmark timeline"})
        kept_contents = {row["sha256"] for row, job in zip(
            [s for s in shards], [j for j in jobs for _ in range(4)], strict=True) if job["state"] != "forgotten"}
        for k in range(content_id):
            live = sha(k) in kept_contents
            contents.append({"sha256": sha(k), "size": 2**26, "state": "live" if live else "deleted",
                             "created_at": T0, "last_referenced_at": T0})
            if live:
                for w in (f"w{k % 3}", f"w{(k + 1) % 3}", "target:store"):
                    copies.append({"sha256": sha(k), "worker_id": w, "state": "verified", "attempts": 0, "size": 2**26,
                                   "stored_at": T0, "verified_at": T0 + timedelta(days=199), "checked_at": T0,
                                   "checksum": None if w.startswith("w") else f"{k:064x}"})
        for table, rows in ((Content, contents), (ContentCopy, copies), (Checkpoint, ckpts),
                            (CheckpointFile, files), (Shard, shards), (Job, jobs), (JobEvent, events)):
            for i in range(0, len(rows), 20_000):
                conn.execute(insert(table), rows[i:i + 20_000])
        conn.execute(insert(CapacitySample), [
            {"at": T0 + timedelta(minutes=10 * i), "used_bytes": 10**12 + i * 10**7, "capacity_bytes": 12 * 10**12,
             "stored_bytes": 10**12 + i * 10**7} for i in range(0, 52_560, 6)])
    return {"checkpoints": n, "events": len(events), "contents": len(contents), "copies": len(copies),
            "shards": len(shards), "fill_s": time.monotonic() - started}


def best_of(fn, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_scale(work: Path) -> dict:
    home = work / "scale"
    home.mkdir(parents=True, exist_ok=True)
    env = {"CKPT_HOME": str(home), "CKPT_MDNS": "0",
           "CKPT_TARGETS": '[{"name": "store", "url": "s3://ckpts/lab", "endpoint": "http://127.0.0.1:9"}]'}
    s = settings_mod.configure(settings_mod.load(environ=env))
    upgrade(s.db_url)
    out = fill(s.db_url)
    t = time.perf_counter()
    optimize(s.db_url)  # as the scheduler does at start (pipeline.service.scheduler)
    out["optimize_s"] = time.perf_counter() - t
    from pipeline.status import status
    from webui import create_app

    out["status_in_process_s"] = best_of(lambda: status(s))
    cli = [sys.executable, "-m", "pipeline.cli", "status"]
    out["status_cli_s"] = best_of(lambda: subprocess.run(cli, env={**env, "PATH": "/usr/bin:/bin"}, check=True,
                                                         capture_output=True))
    app = create_app(settings=s)
    client = app.test_client()
    pages = ["/", "/checkpoints", "/checkpoints?run=/data/runs/r3", "/checkpoints?state=forgotten",
             "/checkpoints?before=50000", "/checkpoints/99999", "/jobs", "/jobs?kind=store&state=forgotten",
             "/jobs/99999", "/health", "/workers", "/metrics", "/api/checkpoints?limit=100", "/api/capacity"]
    out["pages"] = {}
    for page in pages:
        def get(page: str = page) -> None:
            r = client.get(page)
            assert r.status_code == 200, (page, r.status_code, r.get_data(as_text=True)[:300])
        out["pages"][page] = best_of(get)
    out["slowest_page"] = max(out["pages"], key=out["pages"].get)
    return out


def table(scale: dict) -> str:
    lines = [f"control plane at {scale['checkpoints']:,} checkpoints, {scale['events']:,} job events, "
             f"{scale['contents']:,} contents, {scale['copies']:,} copies (filled in {scale['fill_s']:.0f} s, "
             f"then PRAGMA optimize as the scheduler runs it: {1000 * scale.get('optimize_s', 0):.0f} ms)",
             f"  ckpt status: {scale['status_cli_s']:.2f} s as a command, {scale['status_in_process_s']:.2f} s of it "
             "in the query   target <= 0.5 s"]
    for page, seconds in scale["pages"].items():
        lines.append(f"  GET {page:<40} {1000 * seconds:7.0f} ms   target < 300 ms")
    lines.append(f"  median page {1000 * statistics.median(scale['pages'].values()):.0f} ms, slowest "
                 f"{scale['slowest_page']} {1000 * scale['pages'][scale['slowest_page']]:.0f} ms")
    return "\n".join(lines)
