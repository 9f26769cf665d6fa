"""In Chromium: the GC and retention page from the nav, sorting a list by its headers (mouse
and keyboard), pinning and forgetting checked checkpoints through the confirmation page, and a
job page that cannot be live saying so, polling, and going live again.

The rows are written straight into a real control plane and the real web app is served over
HTTP on loopback, in this process (so a test can change its stream limits while it runs).
"""
from __future__ import annotations

import threading
import time

import pytest
from werkzeug.serving import make_server

from pipeline.db.engine import session_scope
from pipeline.db.transitions import create_job, transition
from tests.browser.test_lists import ids_on
from tests.browser.test_ui import fits
from tests.webui.test_checkpoint_list import _many
from webui import streams

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture
def served(web_settings):
    from webui import create_app

    _many(web_settings, runs=("alpha", "beta"), per_run=10)  # ids 1..20; steps 0..900; every 7th failed
    app = create_app({"CKPT_POLL_SECONDS": 1}, settings=web_settings)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", app
    finally:
        server.shutdown()
        thread.join(10)


def log_in(page, base: str, token: str) -> None:
    page.goto(base + "/login")
    page.fill("input[name=token]", token)
    page.click("#login button")
    page.wait_for_url(base + "/")


@pytest.mark.parametrize("width", [1400, 420])
def test_gc_and_retention_page_from_the_nav(served, browser, width, tmp_path):
    base, _app = served
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(base + "/")
    with page.expect_navigation(wait_until="load"):
        page.click("header nav >> text=GC & retention")
    assert page.inner_text("h1") == "GC and retention"
    assert page.locator("#policies tr[data-run]").count() == 2
    assert "no rule set anywhere" in page.inner_text("#policies")
    assert "Nothing to collect" in page.inner_text("#next-collection")
    assert "No collection has run yet." in page.inner_text("#gc-jobs")
    fits(page, tmp_path / f"retention-{width}px.png", "the GC page", width)
    page.close()


def test_sorting_a_list_by_its_headers_with_mouse_and_keyboard(served, browser):
    base, _app = served
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    # Sort the checkpoints by step: a click, then the keyboard (Tab to the header, Enter) reverses.
    page.goto(base + "/checkpoints")
    with page.expect_navigation(wait_until="load"):
        page.click("th[data-sort=step] a")
    assert "sort=step" in page.url and "dir=asc" in page.url
    assert page.get_attribute("th[data-sort=step]", "aria-sort") == "ascending"
    assert ids_on(page)[:2] == [11, 1]  # step 0 of beta and alpha
    page.focus("th[data-sort=step] a")
    with page.expect_navigation(wait_until="load"):
        page.keyboard.press("Enter")
    assert "dir=desc" in page.url and page.get_attribute("th[data-sort=step]", "aria-sort") == "descending"
    assert ids_on(page)[:2] == [20, 10]
    page.reload()  # the sort is in the URL
    assert ids_on(page)[:2] == [20, 10]
    # the jobs list too, by a click
    page.goto(base + "/jobs")
    with page.expect_navigation(wait_until="load"):
        page.click("th[data-sort=id] a")
    assert page.locator("#jobs tr[data-job]").first.get_attribute("data-job") == "1"
    page.close()


def test_bulk_forget_and_pin_with_confirmation(served, browser, web_settings):
    base, _app = served
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    log_in(page, base, web_settings.admin_token())
    page.goto(base + "/checkpoints?sort=step&dir=desc")

    # Check three and forget them: the confirmation says what would happen to each, nothing yet.
    for cid in (3, 10, 8):  # 10 is alpha's newest protected, 8 (step 700) failed: both refused
        page.check(f"#bulk-form input[name=id][value='{cid}']")
    with page.expect_navigation(wait_until="load"):
        page.click("#bulk-forget")
    assert page.inner_text("h1") == "Forget 3 checkpoints?"
    items = page.inner_text("#bulk-items")
    assert "ONLY copy" in page.inner_text("#bulk-items tr[data-id='3']")
    assert "newest protected checkpoint" in page.inner_text("#bulk-items tr[data-id='10']")
    assert "only protected" in page.inner_text("#bulk-items tr[data-id='8']") and "refused" in items
    assert "a local copy still on the training disk is then the ONLY copy" in page.inner_text("#last-copy")
    assert "verified" in page.request.get(base + "/api/checkpoints/3").json()["state"]
    assert "(not the 2 refused)" in page.inner_text("#bulk-confirm button")
    with page.expect_navigation(wait_until="load"):
        page.click("#bulk-confirm button")
    assert page.inner_text("h1") == "Forget: 1 done"
    assert page.request.get(base + "/api/checkpoints/3").json()["state"] == "forgotten"
    with page.expect_navigation(wait_until="load"):
        page.click("#bulk-back")
    assert "sort=step" in page.url and "dir=desc" in page.url  # back where it was asked

    # Pin the whole page from a run's page (the header's checkbox), with a note.
    root = web_settings.roots[0].rstrip("*")
    page.goto(f"{base}/runs?name={root}beta")
    page.check("#check-all")
    page.fill("#bulk-actions input[name=note]", "ablation")
    with page.expect_navigation(wait_until="load"):
        page.click("#bulk-pin")
    assert page.inner_text("h1") == "Pin 10 checkpoints?"
    with page.expect_navigation(wait_until="load"):
        page.click("#bulk-confirm button")
    assert page.inner_text("h1") == "Pin: 10 done"
    page.goto(base + "/retention")
    assert page.locator("#policies tr[data-run$='beta'] .pins a").count() == 10
    assert "ablation" in page.inner_text("#policies tr[data-run$='beta'] .pins")
    page.close()


def restore_job(settings) -> int:
    """A restore waiting in its queue: not resting, so its page follows it."""
    with session_scope(settings.db_url) as s:
        return create_job(s, "restore", checkpoint_id=2, params={"dest": "/tmp/nowhere"}).id


def settled_refusal(tabs, timeout: float = 30) -> int:
    """The index of the one tab that is not live, once the server holds two streams and the
    same one tab says it is not live for 3 s (past a heartbeat and the tabs' 1 s polls: a
    stream asked for is answered by then, a page gone is found gone)."""
    seen, since = None, time.monotonic()
    deadline = since + timeout
    while True:
        now = (tuple(i for i, t in enumerate(tabs) if t.locator("#live-notice").is_visible()), streams.open_count())
        if now != seen:
            seen, since = now, time.monotonic()
        elif len(seen[0]) == 1 and seen[1] == 2 and time.monotonic() - since >= 3:
            return seen[0][0]
        assert time.monotonic() < deadline, f"tabs not live, streams open: {seen}"
        time.sleep(0.2)


def test_a_job_page_that_cannot_be_live_says_so_polls_and_goes_live_again(served, browser, web_settings):
    base, app = served
    job = restore_job(web_settings)
    assert app.config.get("CKPT_STREAMS_PER_CLIENT", 2) == 2
    context = browser.new_context()
    # More tabs than a client's limit: the first two are live, the third is refused (429) and says so.
    tabs = []
    for _ in range(3):
        tab = context.new_page()
        tab.goto(f"{base}/jobs/{job}")
        tabs.append(tab)
        time.sleep(0.5)
    notice = tabs[2].locator("#live-notice")
    notice.wait_for(state="visible", timeout=10_000)
    assert "not live" in notice.inner_text() and "refreshing every 1 s" in notice.inner_text()
    assert all(t.locator("#live-notice").is_hidden() for t in tabs[:2])

    # While not live it polls: a change of state reaches it within a poll.
    with session_scope(web_settings.db_url) as s:
        transition(s, job, "restore", "queued", "gathering")
    for t in tabs:
        t.wait_for_selector("#job-state.gathering", timeout=10_000)
    # Every tab reloaded on the change; the two streams go to whichever two ask first once the
    # server found the old ones gone (at a heartbeat): one of the three, any, is still not live.
    # (It used to be asserted of the third alone, and failed when the reloads raced otherwise.)
    held = tabs[settled_refusal(tabs)]
    # A live tab closes: its slot frees (the server notices at the next heartbeat); the held one goes live.
    live = [t for t in tabs if t is not held]
    live[0].close()
    held.locator("#live-notice").wait_for(state="hidden", timeout=15_000)
    for t in (live[1], held):
        t.close()

    # Forced: no stream at all for this client. A new page says so at once and still follows the job.
    app.config["CKPT_STREAMS_PER_CLIENT"] = 0
    solo = context.new_page()
    solo.goto(f"{base}/jobs/{job}")
    solo.locator("#live-notice").wait_for(state="visible", timeout=10_000)
    with session_scope(web_settings.db_url) as s:
        transition(s, job, "restore", "gathering", "verified")
    solo.wait_for_selector("#job-state.verified", timeout=10_000)
    # The limit is lifted: live again without a reload by hand.
    app.config["CKPT_STREAMS_PER_CLIENT"] = 10
    app.config["CKPT_STREAMS"] = 10
    solo.locator("#live-notice").wait_for(state="hidden", timeout=10_000)
    context.close()
