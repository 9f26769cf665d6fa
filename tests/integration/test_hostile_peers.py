"""Hostile peers on the LAN (a relay, a rogue without the key, garbage answers, a replayed
DELETE, a worker back under a new id), inside a private network namespace: nothing is admitted,
rotated or deleted on their word, and the scheduler's other work is done in the same tick."""
from __future__ import annotations

import pytest

from tests.integration.netns import netns_available, run_scenario

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    if not netns_available():
        pytest.skip("requires unshare -n (root or user namespaces) and iproute2")
    return run_scenario("tests.integration.hostile_scenario", tmp_path_factory.mktemp("hostile"))


def test_only_the_real_workers_are_admitted_and_a_relay_never_moves_one(result):
    urls, nodes = result["urls"], result["nodes"]
    for rows in (result["rows_after_probe"], result["rows_after_second_probe"]):
        up = {wid: url for wid, (url, state) in rows.items() if state == "up"}
        assert up == {nodes["w1"]: urls["w1"], nodes["w2"]: urls["w2"]}
    answers = result["probe_answers"]
    assert "does not reach this storage worker" in answers[urls["relay"]]  # w1 refuses to prove for it
    for stranger in ("rogue", "garbage", "not_json"):
        assert not str(answers[urls[stranger]]).startswith("w-"), (stranger, answers[urls[stranger]])


def test_a_rogue_without_the_key_is_believed_in_nothing(result):
    assert result["rogue_answers_believed"] == {"upload": False, "rehash": False, "stat": False, "status": False}
    assert "could not confirm" in result["confirm_with_rogue"] or "confirmed" in result["confirm_with_rogue"]
    assert result["confirm_with_real_workers"] is None  # the same check passes with two real copies
    assert result["local_copy_kept"] and result["checkpoint_local"]


def test_a_captured_delete_is_worth_nothing_elsewhere_or_again(result):
    replies = result["delete_replies"]
    assert replies["w1"][0] == 200
    assert replies["replayed to w2"][0] == 401 and "meant for storage worker" in replies["replayed to w2"][1]
    assert replies["replayed to w1"][0] == 401 and "replayed" in replies["replayed to w1"][1]
    assert result["w2_still_holds"]


def test_a_tick_among_bad_peers_does_its_other_work(result):
    assert ["shard", [result["stale_job"]]] in result["tick_sent"] or any(
        args == [result["stale_job"]] for _actor, args in result["tick_sent"])
    rows = result["rows_after_tick"]
    assert rows["w-oldnode00000"][1] == "rejected"  # kept (it has copies), no foreign-key failure
    assert rows[result["nodes"]["w2"]][1] == "up"
