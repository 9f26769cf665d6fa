"""Sortable list columns (``?sort=&dir=`` kept in every link) and the GC and retention page."""
from __future__ import annotations

import dataclasses
import re

from sqlalchemy import update

from pipeline import operations
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import create_job
from tests.webui.conftest import seed
from tests.webui.test_checkpoint_list import _many
from webui.data import PAGE


def ids(html: str) -> list[int]:
    return [int(x) for x in re.findall(r"\(id (\d+)\)", html)]


def steps(html: str) -> list[int]:
    return [int(x) for x in re.findall(r'<td class="num">(\d+)</td>', html.split('id="run-checkpoints"')[1])]


def test_lists_sort_by_a_column_both_ways_and_keep_it_in_their_links(client, web_settings):
    _many(web_settings, runs=("alpha", "beta"), per_run=60)  # ids 1..120; steps 0..5900 in each run
    page = client.get("/checkpoints?sort=step&dir=asc").get_data(as_text=True)
    assert ids(page)[:4] == [61, 1, 62, 2]  # step 0 of each run, then 100; a tie: newest first
    assert 'data-sort="step" aria-sort="ascending"' in page
    assert 'href="/checkpoints?sort=step&amp;dir=desc"' in page  # click again: reversed
    assert 'href="/checkpoints?sort=size&amp;dir=asc"' in page  # another column: from ascending
    nxt = re.search(r'id="older" href="([^"]+)"', page).group(1).replace("&amp;", "&")
    assert "sort=step" in nxt and "dir=asc" in nxt and "page=1" in nxt
    rest = client.get(nxt).get_data(as_text=True)
    assert len(ids(page)) == PAGE and sorted(ids(page) + ids(rest)) == list(range(1, 121))
    down = client.get("/checkpoints?sort=step&dir=desc").get_data(as_text=True)
    assert set(ids(down)[:2]) == {60, 120} and 'aria-sort="descending"' in down
    # the filter form keeps the sort
    assert '<input type="hidden" name="sort" value="step">' in down
    # a run's page, sorted oldest step first, across its pages
    root = web_settings.roots[0].rstrip("*")
    run = client.get(f"/runs?name={root}alpha&sort=step").get_data(as_text=True)
    assert steps(run)[:3] == [0, 100, 200]
    # jobs by id ascending; an unknown column is the list's own order
    jobs = client.get("/jobs?sort=id&dir=asc").get_data(as_text=True)
    assert re.findall(r'href="/jobs/(\d+)"', jobs)[:3] == ["1", "2", "3"]
    assert ids(client.get("/checkpoints?sort=nonsense").get_data(as_text=True))[:1] == [120]


def test_workers_sort_by_a_column(client, web_settings):
    seed(web_settings)
    up = client.get("/workers?sort=id").get_data(as_text=True)
    down = client.get("/workers?sort=id&dir=desc").get_data(as_text=True)
    assert up.index("<td>w-0</td>") < up.index("<td>w-1</td>")
    assert down.index("<td>w-1</td>") < down.index("<td>w-0</td>")


def test_gc_and_retention_page_shows_policy_pins_next_collection_and_last_ones(web_settings):
    from webui import create_app

    s = dataclasses.replace(web_settings, remote_keep_last=1, gc_grace_seconds=0.0,
                            run_options='{"*/other": {"keep_last": 3}}')
    client = create_app({"TESTING": True}, settings=s).test_client()
    first, second = seed(s, 1), seed(s, 2)
    operations.pin(s, str(second["checkpoint"]), "the paper's run")
    page = client.get("/").get_data(as_text=True)
    assert 'href="/retention"' in page  # in the nav
    page = client.get("/retention").get_data(as_text=True)
    row = page.split('id="policies"')[1].split("</table>")[0]
    assert "last 1" in row and "the global remote_* settings" in row and "<td class=\"num\">2</td>" in row
    assert "1 checkpoint, " in row and "step 1" in row.split('class="dropped"')[1].split("</td>")[0]
    assert "the paper&#39;s run" in row and "📌" in row
    assert "Nothing to collect" in page

    # Forgotten and its local copy gone: the next collection frees its copies, as the dry run says.
    operations.forget(s, [str(first["checkpoint"])])
    with session_scope(s.db_url) as session:
        session.execute(update(Checkpoint).where(Checkpoint.id == first["checkpoint"]).values(local_present=False))
        create_job(session, "gc", checkpoint_id=None, params={"worker_id": "w-0", "cursor": "", "deleted": 7,
                                                            "bytes": 123_000})
    freed = operations.collect_garbage(s, dry_run=True).freed
    assert freed and all(f.copies for f in freed)
    page = client.get("/retention").get_data(as_text=True)
    table = page.split('id="next-collection"')[1].split("</table>")[0]
    for f in freed:
        assert f"<td>{f.worker_id}</td>" in table and f'<td class="num">{f.copies}</td>' in table
    gc_row = page.split('id="gc-jobs"')[1].split("</table>")[0]
    assert "w-0" in gc_row and '<td class="num">7</td>' in gc_row and "123.0 KB" in gc_row
    doc = client.get("/api/retention").get_json()
    assert doc["next_bytes"] == sum(f.bytes for f in freed) and doc["runs"][0]["pins"][0]["note"] == "the paper's run"
