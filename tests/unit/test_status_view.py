"""``ckpt status`` as text: runs first, each with its checkpoints by step."""
from __future__ import annotations

import re

from pipeline.cli.main import build_parser
from pipeline.db.migrate import upgrade
from tests.webui.test_checkpoint_list import _many


def status_text(settings, capsys, *args: str, verbose: bool = True) -> str:
    """``ckpt status`` (``--verbose``: the full view, with every table) as it prints."""
    parsed = build_parser().parse_args(["--home", str(settings.home), "status", *args,
                                        *(["--verbose"] if verbose else [])])
    assert parsed.func(parsed) == 0
    return capsys.readouterr().out


def test_each_run_lists_its_checkpoints_newest_step_first(settings, capsys):
    upgrade(settings.db_url)
    _many(settings, runs=("alpha", "beta"), per_run=5)  # alpha: ids 1-5, beta: 6-10; steps 0..400
    root = settings.roots[0].rstrip("*")
    out = status_text(settings, capsys)
    alpha, beta = out.index(f"  {root}alpha: 5 checkpoint(s)"), out.index(f"  {root}beta: 5 checkpoint(s)")
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+\S+ \S+ ago\s+(\w+)\s.*\s(checkpoint-\d+)$", out, re.M)
    assert [(int(i), int(step)) for i, step, _state, _name in rows] == [
        (5, 400), (4, 300), (3, 200), (2, 100), (1, 0), (10, 400), (9, 300), (8, 200), (7, 100), (6, 0)]
    first_alpha_row, first_beta_row = out.index("checkpoint-400"), out.rindex("checkpoint-400")
    assert alpha < first_alpha_row < beta < first_beta_row  # under its own run's header
    assert f"{root}alpha/checkpoint" not in out  # a run's rows name checkpoints, not whole paths
    assert ("1", "0", "failed") in {(i, s, st) for i, s, st, _ in rows}  # step 0 failed (0 % 7 == 0)


def test_search_and_run_filter_the_checkpoints(settings, capsys):
    upgrade(settings.db_url)
    _many(settings, runs=("alpha", "beta"), per_run=5)
    root = settings.roots[0].rstrip("*")
    found = status_text(settings, capsys, "--search", "BETA/checkpoint-3")
    assert re.findall(r"^\s+(\d+)\s+\d+\s", found, re.M) == ["9"]
    only = status_text(settings, capsys, "--run", f"{root}alpha")
    assert f"{root}beta" not in only and len(re.findall(r"checkpoint-\d+$", only, re.M)) == 5


def test_status_is_one_line_per_run_under_a_line_of_cluster_health(settings, capsys):
    from datetime import timedelta

    from pipeline.db.engine import session_scope
    from pipeline.db.models import StorageWorker
    from pipeline.db.transitions import now

    upgrade(settings.db_url)
    _many(settings, runs=("alpha", "beta"), per_run=5)  # steps 0..400; step 0 failed in each
    with session_scope(settings.db_url) as s:
        for wid, state in (("w1", "up"), ("w2", "up"), ("w3", "down")):
            s.add(StorageWorker(id=wid, url=f"http://127.0.0.1:1/{wid}", source="static", state=state,
                                capacity_bytes=270_550_000_000, free_bytes=80 * 10**9, used_bytes=201_300_000,
                                last_seen=now() - timedelta(seconds=3)))
    root = settings.roots[0].rstrip("*")
    out = status_text(settings, capsys, verbose=False)
    lines = out.splitlines()
    assert lines[0].startswith("cluster: ATTENTION: 1 worker(s) DOWN, 2 failed job(s) | 2 of 3 storage worker(s) up")
    assert re.search(r"\| [\d.,]+ (bytes|kB|MB|GB|TB) used of [\d.,]+ (bytes|kB|MB|GB|TB) \|", lines[0]), lines[0]
    assert re.split(r"\s{2,}", lines[1]) == ["RUN", "NEWEST", "PROTECTED", "PROBLEMS"]
    runs = [re.split(r"\s{2,}", line) for line in lines[2:4]]
    assert runs == [[f"{root}alpha", "checkpoint-400 verified", "4/5", "1 failed"],
                    [f"{root}beta", "checkpoint-400 verified", "4/5", "1 failed"]]
    assert "checkpoint-300" not in out and "storage workers:" not in out  # the tables are --verbose's
    full = status_text(settings, capsys)
    assert "checkpoint-300" in full and "storage workers:" in full and "used 201.3 MB, free 80.0 GB of 270.6 GB" in full
    # a filter asks for the checkpoints: the full view
    assert "checkpoint-300" in status_text(settings, capsys, "--run", f"{root}alpha", verbose=False)


def test_status_runs_without_the_cyclic_collector_and_gives_it_back(settings, capsys):
    """`ckpt status` ends in a fraction of a second: the collector would only walk, again and
    again, the modules it imports (pipeline.cli.common.collection_paused). After it, collection
    is as it was: this process (a test, a caller of ``main``) goes on collecting."""
    import gc

    upgrade(settings.db_url)
    _many(settings, runs=("alpha",), per_run=5)
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    parsed = build_parser().parse_args(["--home", str(settings.home), "status", "--verbose"])
    gc.callbacks.append(count)
    try:
        assert parsed.func(parsed) == 0
    finally:
        gc.callbacks.remove(count)
    assert "checkpoint-400" in capsys.readouterr().out
    assert collections == [], "collected while status ran (or all at once after it)"
    assert gc.isenabled()
