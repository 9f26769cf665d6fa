"""The checkpoints list: search, filters and pagination over hundreds of checkpoints in several runs."""
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import insert

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job
from pipeline.db.transitions import now
from webui.data import PAGE


def _many(settings, runs=("alpha", "beta", "gamma"), per_run=120) -> None:
    """``per_run`` verified checkpoints in each run, as rows (the list reads rows only)."""
    t = now()
    root = settings.roots[0].rstrip("*")
    with session_scope(settings.db_url) as s:
        rows, i = [], 0
        for run in runs:
            for step in range(per_run):
                i += 1
                rows.append({"id": i, "path": f"{root}{run}/checkpoint-{step * 100}", "run": f"{root}{run}",
                             "name": f"checkpoint-{step * 100}", "is_dir": True, "version": f"v{i}",
                             "step": step * 100, "mtime": (t - timedelta(minutes=per_run - step)).timestamp(),
                             "total_bytes": 10**6, "local_present": True, "current": True, "host": None,
                             "store_state": "verified" if step % 7 else "failed", "detected_at": t})
        s.execute(insert(Checkpoint), rows)
        s.execute(insert(Job), [{"kind": "store", "checkpoint_id": r["id"], "state": r["store_state"], "attempts": 0,
                                 "params": {}, "bytes_done": 0, "bytes_total": 0, "created_at": t, "updated_at": t}
                                for r in rows])


def test_search_filters_and_pages_of_hundreds_of_checkpoints(client, web_settings):
    _many(web_settings)
    first = client.get("/checkpoints").get_data(as_text=True)
    assert first.count('<td class="num">1.0 MB</td>') == PAGE and 'id="older"' in first
    assert "gamma/checkpoint-11900" in first or "checkpoint-11900</a>" in first
    found = client.get("/checkpoints?q=BETA/checkpoint-1150").get_data(as_text=True)  # any case
    assert found.count('<td class="num">1.0 MB</td>') == 1 and "checkpoint-11500" in found
    failed_alpha = client.get(f"/checkpoints?state=failed&run={web_settings.roots[0].rstrip('*')}alpha")
    html = failed_alpha.get_data(as_text=True)
    assert html.count('class="state failed"') == 18 and "beta" not in html.split('id="checkpoints"')[1]
    assert "No checkpoint matches." in client.get("/checkpoints?q=nothing-like-this").get_data(as_text=True)
    # every page of the list, by its "older" link, each checkpoint once
    seen, url = [], "/checkpoints?q=checkpoint-"
    while url:
        html = client.get(url).get_data(as_text=True)
        seen += [int(x) for x in __import__("re").findall(r'\(id (\d+)\)', html)]
        m = __import__("re").search(r'id="older" href="([^"]+)"', html)
        url = m.group(1).replace("&amp;", "&") if m else None
    assert sorted(seen) == list(range(1, 361))
    api = client.get("/api/checkpoints?q=gamma&limit=500").get_json()
    assert len(api["checkpoints"]) == 120
