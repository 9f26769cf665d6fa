"""zeroconf discovery and admission, inside a private network namespace (never on real interfaces)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def netns_available() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not netns_available(), reason="requires unshare -n (root or user namespaces) and iproute2")
def test_two_workers_are_discovered_and_admitted_and_a_rogue_is_rejected(tmp_path):
    script = f"ip link set lo up && exec {sys.executable} -m tests.integration.mdns_scenario {tmp_path}"
    r = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=240)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(lines[-1][len("RESULT "):])
    workers = doc["workers"]
    for url in doc["good_urls"]:
        _id, state, source = workers[url]
        assert (state, source) == ("up", "mdns")
    _id, state, source = workers[doc["rogue_url"]]
    assert (state, source) == ("rejected", "mdns")
    assert doc["store_state"] == "verified"
    assert doc["rogue_files"] == []  # the rogue never received a shard
    print(f"discovered and admitted in {doc['discovered_in_s']} s")
