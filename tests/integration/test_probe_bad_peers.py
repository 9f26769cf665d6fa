"""One bad peer never keeps the others' probes from being recorded: real storage worker
processes on a static list beside peers that answer SSH, garbage, nothing, a web page or half
an answer, on 127.0.0.1. Each probe records every real worker; one that goes down (its port
taken over by an SSH server) is marked with a reason that names it, and is seen again when it
comes back."""
from __future__ import annotations

import contextlib
from datetime import datetime

import pytest
from sqlalchemy import select

from pipeline.cluster.membership import probe_all
from pipeline.db.engine import session_scope
from pipeline.db.models import StorageWorker
from tests.bad_peers import KINDS, bad_peer
from tests.processes import KEY, storage_workers, with_settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    with storage_workers(tmp_path_factory.mktemp("probe-bad-peers"), 2) as ws:
        yield ws


def rows(settings) -> dict[str, tuple[str, str, str | None, datetime | None]]:
    """Per recorded worker: (url, state, last error, last seen)."""
    with session_scope(settings.db_url) as s:
        return {w.id: (w.url, w.state, w.last_error, w.last_seen) for w in s.scalars(select(StorageWorker))}


def test_each_probe_records_every_good_worker_beside_bad_peers_and_a_worker_that_returns(db, two):
    good, victim = two
    with contextlib.ExitStack() as stack:
        bad = {kind: stack.enter_context(bad_peer(kind)) for kind in KINDS}
        settings = with_settings(db, cluster_key=KEY, workers=(good.url, victim.url, *bad.values()),
                                 probe_seconds=0.5, worker_down_seconds=0)

        first = probe_all(settings)
        seen = rows(settings)
        assert {w: seen[w][1] for w in (good.node_id, victim.node_id)} == {good.node_id: "up", victim.node_id: "up"}
        for kind, url in bad.items():  # each bad peer's own answer, and no real worker took its place
            assert not str(first.answers[url]).startswith("w-"), kind
            assert url in first.answers[url] or kind == "not_json", (kind, first.answers[url])
        # An unsigned answer is a stranger's: listed (an operator named it), rejected, with why.
        assert [(state, error) for u, state, error, _ in seen.values() if u == bad["not_json"]] == [
            ("rejected", "failed the cluster-key challenge: it does not hold the cluster key")]

        victim.stop()
        with bad_peer("ssh", port=victim.port):  # another service took the worker's port
            down = probe_all(settings)
            after = rows(settings)
        assert down.went_down == [victim.node_id]
        url, state, error, _ = after[victim.node_id]
        assert state == "down" and url == victim.url
        assert "not HTTP" in str(error) and victim.url in str(error), error
        assert after[good.node_id][1] == "up" and after[good.node_id][3] > seen[good.node_id][3]

        victim.start()
        back = probe_all(settings)
        final = rows(settings)
    assert back.returned == [victim.node_id]
    assert final[victim.node_id][1] == "up" and final[victim.node_id][2] is None
    assert final[good.node_id][3] > after[good.node_id][3]
