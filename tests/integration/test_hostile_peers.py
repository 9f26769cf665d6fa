"""Hostile peers on the LAN (a relay, a rogue without the key, garbage answers, a replayed
DELETE, a worker back under a new id), inside a private network namespace: nothing is admitted,
rotated or deleted on their word, and the scheduler's other work is done in the same tick."""
from __future__ import annotations

import pytest

from tests.faults.harness import Table, Verdict
from tests.integration.netns import netns_available, run_scenario

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trials_run(request, tmp_path_factory) -> list[dict]:
    """The scenario's results, once per trial (``--soak N``)."""
    if not netns_available():
        pytest.skip("requires unshare -n (root or user namespaces) and iproute2")
    return [run_scenario("tests.integration.hostile_scenario", tmp_path_factory.mktemp("hostile"))
            for _ in range(max(1, request.config.getoption("--soak")))]


@pytest.fixture(scope="module")
def result(trials_run) -> dict:
    return trials_run[0]


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


def _verdicts(doc: dict) -> dict[str, tuple[Verdict, str]]:
    """Per hostile input, what one trial did: data lost, anything unsafe (admitted, believed,
    deleted or rotated on a stranger's word), and the outcome, from the scenario's evidence."""
    urls, nodes = doc["urls"], doc["nodes"]
    rows = doc["rows_after_second_probe"]
    admitted = {url for url, state in rows.values() if state == "up"}
    real_moved = rows[nodes["w1"]][0] != urls["w1"]
    replies = doc["delete_replies"]
    believed = doc["rogue_answers_believed"]
    tick = doc["tick_sent"]
    return {
        "relay forwarding probes to a real worker": (
            Verdict(unsafe=int(urls["relay"] in admitted or real_moved)),
            "refused (421)" if "does not reach" in doc["probe_answers"][urls["relay"]] else "answered"),
        "rogue answering uploads, re-hashes, stats without the key": (
            Verdict(lost=int(not doc["local_copy_kept"]),
                    unsafe=int(any(believed.values()) or doc["confirm_with_rogue"] is None)),
            "nothing believed" if not any(believed.values()) else "believed"),
        "captured DELETE replayed to another worker and again": (
            Verdict(lost=int(not doc["w2_still_holds"]),
                    unsafe=int(replies["replayed to w2"][0] < 400 or replies["replayed to w1"][0] < 400)),
            "refused twice"),
        "candidates answering garbage or not JSON": (
            Verdict(unsafe=int(bool({urls["garbage"], urls["not_json"], urls["rogue"]} & admitted))),
            "rejected, tick went on" if any(args == [doc["stale_job"]] for _a, args in tick) else "tick stopped"),
        "rejected worker with copies back under a new node id": (
            Verdict(problems=[] if doc["rows_after_tick"].get("w-oldnode00000", [None, None])[1] == "rejected"
                    and doc["rows_after_tick"][nodes["w2"]][1] == "up" else ["rows not as expected"]),
            "kept rejected, new id admitted"),
    }


def test_hostile_inputs_are_rows_of_the_fault_table(trials_run):
    rows = {}
    for doc in trials_run:
        for fault, (verdict, outcome) in _verdicts(doc).items():
            row = rows.get(fault) or rows.setdefault(fault, Table.row(f"hostile: {fault}"))
            row.add(verdict, 0.0, outcome)  # nothing to recover from: refused as it came
    bad = {fault: (r.lost, r.unsafe, r.problems) for fault, r in rows.items() if not r.ok}
    assert not bad, bad
