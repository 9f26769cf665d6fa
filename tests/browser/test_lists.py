"""Hundreds of checkpoints in several runs, in Chromium at a wide and a phone's width: search,
pagination of the checkpoints list and of a run's page, the protected marks.

The rows are written straight into a real control plane (the lists read rows only) and the
real web app is served over HTTP on loopback.
"""
from __future__ import annotations

import re
import threading

import pytest
from werkzeug.serving import make_server

from tests.browser.test_ui import fits as fits_screen
from tests.webui.test_checkpoint_list import _many
from webui.data import PAGE

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture
def served(web_settings):
    from webui import create_app

    _many(web_settings)  # alpha, beta, gamma: 120 each; every 7th step failed
    server = make_server("127.0.0.1", 0, create_app({}, settings=web_settings), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", web_settings.roots[0].rstrip("*")
    finally:
        server.shutdown()
        thread.join(10)


def ids_on(page) -> list[int]:
    return [int(m) for t in page.locator("a[title*='(id ']").evaluate_all("els => els.map(e => e.title)")
            for m in re.findall(r"\(id (\d+)\)", t)]


@pytest.mark.parametrize("width", [1400, 420])
def test_hundreds_of_checkpoints_searched_and_paged_in_the_browser(served, browser, width, tmp_path):
    base, root = served
    page = browser.new_page(viewport={"width": width, "height": 900})

    def follow(selector: str) -> None:
        """Click a link or a form's button and wait until the page it leads to has loaded
        (a click returns once the navigation has started: reading then sees an empty page)."""
        with page.expect_navigation(wait_until="load"):
            page.click(selector)

    def fits(name: str) -> None:
        fits_screen(page, tmp_path / f"{name}-{width}px.png", name, width)

    # The checkpoints list: one page, then every page by its "older" link, each checkpoint once.
    page.goto(base + "/checkpoints")
    assert len(ids_on(page)) == PAGE
    fits("checkpoints")
    seen = ids_on(page)
    while page.locator("#older").count():
        assert len(ids_on(page)) == PAGE  # only the last page is short
        follow("#older")
        seen += ids_on(page)
    assert sorted(seen) == list(range(1, 361))

    # Search as a user types it (any case), with the run picked in the dropdown.
    page.goto(base + "/checkpoints")
    page.fill("input[name=q]", "CHECKPOINT-115")
    page.select_option("select[name=run]", f"{root}gamma")
    follow("form.filters button")
    assert ids_on(page) == [241 + 115]
    assert page.input_value("input[name=q]") == "CHECKPOINT-115"  # the form keeps what was typed
    page.fill("input[name=q]", "no-such-checkpoint")
    follow("form.filters button")
    assert "No checkpoint matches." in page.inner_text("#checkpoints")

    # A run's page, from the overview: its checkpoints by step, newest first, across pages.
    page.goto(base + "/")
    follow(f"#runs a[href$='{root}beta']")
    assert page.inner_text("h1") == "Run runs/beta"
    assert "step 11800" in page.inner_text("#run-facts")  # 11900 failed: the newest protected is 11800
    fits("run")
    steps: list[int] = []
    while True:
        steps += [int(t) for t in page.locator("#run-checkpoints tr td:first-child.num").all_inner_texts()]
        marked = page.locator("#run-checkpoints tr:has(.protected) td:first-child").all_inner_texts()
        failed = page.locator("#run-checkpoints tr:has(td.state.failed) td:first-child").all_inner_texts()
        assert marked and failed and not set(marked) & set(failed)
        if not page.locator("#older").count():
            break
        follow("#older")
    assert steps == list(range(11900, -1, -100))
    page.close()
