"""The checkpoints list: search, filters and pagination over hundreds of checkpoints in several runs."""
from __future__ import annotations

import re
from datetime import timedelta

from sqlalchemy import func, insert, select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job
from pipeline.db.transitions import now
from webui.data import PAGE


def _many(settings, runs=("alpha", "beta", "gamma"), per_run=120) -> None:
    """``per_run`` verified checkpoints in each run, as rows (the list reads rows only)."""
    t = now()
    root = settings.roots[0].rstrip("*")
    with session_scope(settings.db_url) as s:
        rows, i = [], s.scalar(select(func.max(Checkpoint.id))) or 0
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
        seen += [int(x) for x in re.findall(r'\(id (\d+)\)', html)]
        m = re.search(r'id="older" href="([^"]+)"', html)
        url = m.group(1).replace("&amp;", "&") if m else None
    assert sorted(seen) == list(range(1, 361))
    api = client.get("/api/checkpoints?q=gamma&limit=500").get_json()
    assert len(api["checkpoints"]) == 120


def ids_in(html: str) -> list[int]:
    return [int(x) for x in re.findall(r'\(id (\d+)\)', html)]


def test_run_page_lists_a_runs_checkpoints_by_step_with_the_protected_ones_marked(client, web_settings):
    _many(web_settings)
    root = web_settings.roots[0].rstrip("*")
    html = client.get(f"/runs?name={root}beta").get_data(as_text=True)
    table = html.split('id="run-checkpoints"')[1]
    steps = [int(x) for x in re.findall(r'<td class="num">(\d+)</td>', table)]
    assert steps == list(range(11900, 11900 - PAGE * 100, -100))  # newest step first, one page
    assert "gamma" not in table and "alpha" not in table
    # step 11900 failed (119 % 7 == 0): the newest protected is 11800; failed ones carry no mark
    assert re.findall(r'class="newest-protected"><td class="num">(\d+)<', table) == ["11800"]
    assert "step 11800" in html.split('id="run-facts"')[1]
    rows = table.split("<tr")[2:]
    assert all(('class="protected"' in r) == ('class="state verified"' in r) for r in rows if "<td" in r)
    assert sum('class="state failed"' in r for r in rows) == sum(1 for s in range(120 - PAGE, 120) if s % 7 == 0)
    # every page by its link, each of the run's checkpoints once, in step order across pages
    seen, url = [], f"/runs?name={root}beta"
    while url:
        page = client.get(url).get_data(as_text=True)
        seen += ids_in(page)
        m = re.search(r'id="older" href="([^"]+)"', page)
        url = m.group(1).replace("&amp;", "&") if m else None
    assert seen == list(range(240, 120, -1))
    assert ids_in(client.get(f"/runs?name={root}beta&q=CHECKPOINT-5&state=verified").get_data(as_text=True)) == [
        121 + s for s in sorted((s for s in range(120) if str(s * 100).startswith("5") and s % 7), reverse=True)]
    assert client.get(f"/runs?name={root}nope").status_code == 404
    api = client.get(f"/api/runs?name={root}beta&page=1").get_json()
    assert api["summary"]["protected_step"] == 11800 and len(api["checkpoints"]) == 120 - PAGE
    assert api["more"] is False and client.get("/api/runs").status_code == 400
    # the overview and the list link to it
    assert f'href="/runs?name={root}beta"' in client.get("/").get_data(as_text=True)


def test_jobs_workers_and_dead_letters_are_searchable(client, web_settings):
    from tests.webui.conftest import seed
    from tests.webui.test_api import dead_letter

    ids = seed(web_settings)
    _many(web_settings, runs=("delta",), per_run=5)  # ids after the seeded one's
    jobs = client.get("/jobs?q=delta/checkpoint-300").get_data(as_text=True)
    assert re.findall(r'data-job="(\d+)"', jobs) and "checkpoint-300" in jobs and "step_1" not in jobs
    for q in (str(ids["restore_job"]), f"%23{ids['restore_job']}"):  # 12 or #12: the job, not a path with a 12
        by_id = client.get(f"/jobs?q={q}").get_data(as_text=True)
        assert re.findall(r'data-job="(\d+)"', by_id) == [str(ids["restore_job"])]
    by_param = client.get("/api/jobs?q=/tmp/x").get_json()["jobs"]  # a restore's destination
    assert [j["id"] for j in by_param] == [ids["restore_job"]]
    assert "No job matches." in client.get("/jobs?q=zzz-nothing").get_data(as_text=True)
    workers = client.get("/workers?q=7001").get_data(as_text=True)
    assert "w-1" in workers and "w-0" not in workers
    assert [w["id"] for w in client.get("/api/workers?q=W-0").get_json()["workers"]] == ["w-0"]
    dead_letter("shard", (424242,))
    dead_letter("scrub", (515151,))
    page = client.get("/dead-letters?q=515151").get_data(as_text=True)
    assert "515151" in page and "424242" not in page
    assert [d["actor"] for d in client.get("/api/dead-letters?q=SHARD").get_json()["dead_letters"]] == ["shard"]
    iso = client.get("/api/dead-letters").get_json()["dead_letters"][0]["failed_at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)", iso), iso


def test_a_runs_usage_alone_is_what_it_is_among_every_run(web_settings):
    """The run page asks for one run's usage: content another run shares is still 'shared'."""
    import shutil
    from pathlib import Path

    from pipeline import capacity
    from pipeline.detection import catalog, completeness, roots
    from tests.webui.conftest import seed

    ids = seed(web_settings)
    other = Path(web_settings.roots[0].rstrip("*")) / "r2"
    other.mkdir()
    copy = other / "step_1.safetensors"
    shutil.copyfile(ids["path"], copy)  # the same content, referenced by a second run
    run, path = roots.locate(copy, web_settings.roots)
    detected = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=web_settings.shard_size)
    with session_scope(web_settings.db_url) as s:
        catalog.record(s, detected, lease_seconds=60, detail="second run")
    with session_scope(web_settings.db_url) as s:
        every = capacity.per_run(s)
        r1 = str(Path(ids["path"]).parent)
        assert every[r1]["shared"] > 0 and every[r1]["unique"] == 0
        assert capacity.per_run(s, [r1]) == {r1: every[r1]}


def test_workers_and_dead_letters_come_a_page_at_a_time(client, web_settings, monkeypatch):
    from pipeline.db.models import StorageWorker
    from tests.webui.test_api import dead_letter
    from webui import data

    monkeypatch.setattr(data, "PAGE", 3)
    with session_scope(web_settings.db_url) as s:
        s.add_all(StorageWorker(id=f"w-{i:02d}", url=f"http://10.0.0.{i}:7070", source="static", state="up",
                                free_bytes=10**10, capacity_bytes=10**10, last_seen=now()) for i in range(7))
    seen, url = [], "/workers"
    while url:
        html = client.get(url).get_data(as_text=True)
        seen += re.findall(r"<tr><td>(w-\d\d)</td>", html)
        m = re.search(r'id="older" href="([^"]+)"', html)
        url = m.group(1).replace("&amp;", "&") if m else None
    assert seen == [f"w-{i:02d}" for i in range(7)]  # every worker once, in order, three at a time
    api = client.get("/api/workers?page=2").get_json()
    assert [w["id"] for w in api["workers"]] == ["w-06"] and api["more"] is False
    assert client.get("/api/workers?page=0").get_json()["more"] is True
    for n in range(4):
        dead_letter("scrub", (700 + n,))
    first = client.get("/api/dead-letters").get_json()
    second = client.get("/api/dead-letters?page=1").get_json()
    assert (len(first["dead_letters"]), first["more"]) == (3, True)
    assert (len(second["dead_letters"]), second["more"]) == (1, False)
    html = client.get("/dead-letters?page=1").get_data(as_text=True)
    assert 'id="newer"' in html and 'id="older"' not in html and html.count("<td>scrub</td>") == 1
