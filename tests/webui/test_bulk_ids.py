"""Bulk actions take checkpoint ids, never paths (found by an outside review): each id used to be
resolved as `ckpt forget` resolves a ref: an id with no row was then read as a PATH from the web UI's working
directory. Step directories named by number (Orbax, `<run>/12000/`) make that a real checkpoint."""
from __future__ import annotations

from sqlalchemy import update

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from tests.webui.test_bulk import bulk, state_of
from tests.webui.test_checkpoint_list import _many


def test_bulk_forget_of_an_unknown_id_does_not_forget_a_step_directory_of_that_number(
        client, token, web_settings, tmp_path, monkeypatch):
    _many(web_settings, runs=("alpha",), per_run=10)  # ids 1..10; 10 the newest protected
    run = tmp_path / "orbax-run"
    run.mkdir()
    with session_scope(web_settings.db_url) as s:  # checkpoint 3 is the run's step directory 12000
        s.execute(update(Checkpoint).where(Checkpoint.id == 3).values(path=str(run / "12000")))
    monkeypatch.chdir(run)  # `ckpt up` (and so the web UI) started from the run directory
    # A stale list / a script's typo asks to forget checkpoint id 12000, which does not exist.
    result = bulk(client, token, action="forget", checkpoints=[12000]).get_json()
    assert not result["results"][0]["ok"], result["results"][0]
    assert state_of(client, 3) == "verified"
