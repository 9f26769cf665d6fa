"""zeroconf discovery and admission, inside a private network namespace (never on real interfaces)."""
from __future__ import annotations

import pytest

from tests.integration.netns import netns_available, run_scenario

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not netns_available(), reason="requires unshare -n (root or user namespaces) and iproute2")
def test_two_workers_are_discovered_and_admitted_and_strangers_are_not_listed(tmp_path):
    doc = run_scenario("tests.integration.mdns_scenario", tmp_path)
    workers = doc["workers"]
    for url in doc["good_urls"]:
        _id, state, source = workers[url]
        assert (state, source) == ("up", "mdns")
    assert doc["rogue_url"] not in workers  # strangers are not listed
    assert doc["store_state"] == "verified"
    assert doc["rogue_files"] == []  # the rogue never received a shard
    print(f"discovered and admitted in {doc['discovered_in_s']} s")
