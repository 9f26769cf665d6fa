"""``ckpt status`` as text: runs first, each with its checkpoints by step."""
from __future__ import annotations

import re

from pipeline.cli.main import build_parser
from pipeline.db.migrate import upgrade
from tests.webui.test_checkpoint_list import _many


def status_text(settings, capsys, *args: str) -> str:
    parsed = build_parser().parse_args(["--home", str(settings.home), "status", *args])
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
