"""The web UI in a real browser (headless Chromium + Playwright) against a running ckpt up.

Screenshots of every page are kept under the test's temporary directory
(``<tmp>/screenshots/*.png``) and checked not to be blank.
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from pipeline.cluster.client import free_port
from tests.checkpoints import atomic_save, files_of, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser]


#: The elements that reach past the right edge of the window (what makes a page too wide).
WIDER = """Array.from(document.querySelectorAll('body *')).map(e => [e,
    e.getBoundingClientRect().right + parseFloat(getComputedStyle(e).marginRight || 0)])
  .filter(([e, right]) => right > innerWidth + 0.5).slice(0, 8)
  .map(([e, right]) => e.tagName + (e.id ? '#' + e.id : '') + (e.className ? '.' + e.className : '') + ' '
    + Math.round(right))"""


def not_blank(png: Path) -> bool:
    """True when the screenshot has real content: many distinct colours, not one flat fill."""
    from PIL import Image

    with Image.open(png) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    return colours is None or len(colours) > 20


def fits(page, out: Path, name: str, width: int) -> None:
    """Screenshot the page to ``out``: it is not blank and no wider than the window."""
    page.screenshot(path=str(out), full_page=True)
    assert not_blank(out), f"{name} at {width} px is blank"
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"{name} is {scroll} px wide at {width} px: {page.evaluate(WIDER)}"


def api(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return json.loads(r.read())


def test_every_page_store_restore_and_requeue_in_the_browser(make_cluster, browser, tmp_path):
    port = free_port()
    points = tmp_path / "failpoints"
    points.mkdir()
    (points / "verify.commit1.before").write_text("always raise\n")  # every verify fails, until removed
    (points / "repair.commit1.before").write_text("always raise\n")  # a damaged copy stays damaged
    cluster = make_cluster(env={"CKPT_WEB_PORT": str(port), "CKPT_MAX_RETRIES": "1", "CKPT_SCRUB_CRON": "",
                                "CKPT_FAILPOINTS": str(points)})
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(base), 60, "the web UI")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    run = cluster.runs / "run"
    run.mkdir()

    # While every verify fails, the first store is dead-lettered.
    first = atomic_save(state_dict(1), run / "step_1.safetensors")
    first_job = checkpoint_job(cluster, first)
    cluster.wait_job(first_job, ("failed",), timeout=60)

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(base + "/login")
    page.fill("input[name=token]", cluster.settings.admin_token())
    page.click("#login button")
    page.wait_for_url(base + "/")

    def shoot(name: str, path: str) -> None:
        page.goto(base + path)
        page.wait_for_load_state("load")
        shoot_here(name)

    def shoot_here(name: str) -> None:
        out = shots / f"{name}.png"
        page.screenshot(path=str(out), full_page=True)
        assert not_blank(out), f"{name} screenshot is blank"

    for name, path in [("overview", "/"), ("checkpoints", "/checkpoints"), ("checkpoint", "/checkpoints/1"),
                       ("health", "/health"), ("jobs", "/jobs"), ("job", f"/jobs/{first_job}"),
                       ("workers", "/workers"), ("dead-letters", "/dead-letters"), ("actions", "/actions")]:
        shoot(name, path)
    page.goto(base + "/dead-letters")
    rows = page.locator("#dead-letters tr:has(button)")
    assert rows.count() == 1 and rows.locator("td").nth(1).inner_text() == "verify"

    # The cause is gone; requeue the dead letter from the page: the first store completes.
    (points / "verify.commit1.before").unlink()
    page.goto(base + "/dead-letters")
    page.click("#requeue-all")
    page.wait_for_selector("text=requeued 1 message(s)")
    cluster.wait_job(first_job, ("verified",), timeout=60)

    # Store from the form and watch the job page update live to 'verified'.
    second = atomic_save(state_dict(2, layers=8, width=128), run / "step_2.safetensors")
    page.goto(base + "/actions")
    page.fill("#store-form input[name=path]", str(second))
    page.click("#store-form button")
    page.wait_for_url(f"{base}/jobs/*")
    page.wait_for_selector("#job-state.verified", timeout=60_000)
    shoot("store-verified", page.url.removeprefix(base))

    # Restore it from the form; the file comes back byte for byte.
    dest = tmp_path / "restored.safetensors"
    second_id = next(c["id"] for c in api(base, "/api/checkpoints")["checkpoints"] if c["path"] == str(second))
    page.goto(base + "/actions")
    page.select_option("#restore-form select[name=checkpoint]", str(second_id))
    page.fill("#restore-form input[name=dest]", str(dest))
    page.click("#restore-form button")
    page.wait_for_url(f"{base}/jobs/*")
    page.wait_for_selector("#job-state.done", timeout=60_000)
    shoot("restore-done", page.url.removeprefix(base))
    assert files_of(dest) == files_of(second)

    shoot("overview-after", "/")
    assert page.locator("svg.chart rect.bar-store").count() >= 2
    assert page.locator("svg.chart rect.bar-restore").count() == 1

    # Restore from the checkpoint's own page: the destination is checked as it is typed.
    page.goto(f"{base}/checkpoints/{second_id}")
    page.fill("#restore-form input[name=dest]", "/etc/ckpt-browser-test")
    page.wait_for_selector("#restore-verdict.error")
    assert "outside the restore roots" in page.inner_text("#restore-verdict")
    assert page.locator("#restore-form button").is_disabled()
    shoot_here("checkpoint-bad-destination")
    again = tmp_path / "again.safetensors"
    page.fill("#restore-form input[name=dest]", str(again))
    page.wait_for_selector("#restore-verdict.ok")
    assert page.locator("#restore-form button").is_enabled() and "load_state_dict" in page.inner_text("#load-snippet")
    page.click("#restore-form button")
    page.wait_for_url(f"{base}/jobs/*")
    page.wait_for_selector("#job-state.done", timeout=60_000)
    assert files_of(again) == files_of(second)

    # A corrupted copy (repair held back): found by a scrub started from the page, shown by the
    # problems-only view of the health matrix.
    worker_id, sha, _seq = cluster.copies(second)[0]
    shard = cluster.worker(worker_id).shard(sha)
    shard.write_bytes(b"\0" * 4096 + shard.read_bytes()[4096:])
    page.goto(base + "/actions")
    page.click("#scrub-form button")
    wait_for(lambda: all(j["state"] == "done" for j in api(base, "/api/jobs?kind=scrub")["jobs"]), 90, "the scrub")
    page.goto(base + "/health?problems=1")
    assert page.locator("details.matrix-group").count() == 1
    assert page.locator("table.matrix td.cell.corrupt").count() == 1
    assert page.locator("table.matrix tr").count() == 2  # the header and the damaged shard only
    shoot_here("health-problems")

    # Every page at a phone's width: nothing wider than the screen, and real content.
    narrow = browser.new_page(viewport={"width": 420, "height": 900})
    narrow.context.add_cookies(page.context.cookies())
    for name, path in [("overview", "/"), ("checkpoints", "/checkpoints"), ("checkpoint", f"/checkpoints/{second_id}"),
                       ("health", "/health"), ("jobs", "/jobs"), ("job", f"/jobs/{first_job}"),
                       ("workers", "/workers"), ("actions", "/actions")]:
        narrow.goto(base + path)
        narrow.wait_for_load_state("load")
        out = shots / f"{name}-420px.png"
        narrow.screenshot(path=str(out), full_page=True)
        assert not_blank(out), f"{name} at 420 px is blank"
        width = narrow.evaluate("document.documentElement.scrollWidth")
        assert width <= 420, f"{name} is {width} px wide at 420 px: {narrow.evaluate(WIDER)}"
    print("screenshots:", ", ".join(sorted(p.name for p in shots.iterdir())))


def _answers(base: str) -> bool:
    try:
        return "checkpoints" in api(base, "/api/checkpoints")
    except OSError:
        return False
