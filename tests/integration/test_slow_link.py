"""An upload that takes several times the lease: one upload per copy, no duplicate, no
failed job (the lease is renewed by time while the transfer runs)."""
from __future__ import annotations

import shutil

import pytest

from tests.integration.netns import netns_available, run_scenario

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not netns_available() or not shutil.which("tc"),
                    reason="requires unshare -n (root or user namespaces) and tc")
def test_an_upload_longer_than_the_lease_is_sent_once(tmp_path):
    doc = run_scenario("tests.integration.slow_link_scenario", tmp_path)
    assert doc["seconds"] > 3 * doc["lease_s"], doc  # the link really was slower than the lease
    assert doc["state"] in ("verified", "rotated"), doc
    assert doc["copy_attempts"] and set(doc["copy_attempts"]) == {1}, doc  # each copy uploaded once
    assert doc["redriven"] == [], doc
