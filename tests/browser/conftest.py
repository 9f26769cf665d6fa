"""Browser tests share the integration cluster fixtures, and drive Debian's Chromium (never a
browser downloaded by a tool)."""
import os
import shutil

import pytest

from tests.integration.conftest import make_cluster  # noqa: F401

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed: `./dev test` installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()
