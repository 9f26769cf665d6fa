"""``ckpt workers``: the list, drain (and its progress), undrain and remove, on a control plane
whose rows the test writes (the real drain, with processes, is tests/integration/test_workers_cli.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
from sqlalchemy import select

from pipeline import operations
from pipeline.cli.main import main
from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Content, ContentCopy, StorageWorker
from pipeline.db.transitions import now
from pipeline.errors import CkptError
from pipeline.units import human_bytes

A, B = "a" * 64, "b" * 64


def cluster_rows(settings) -> None:
    """w1 holds A (its only copy, 3 kB) and B; w2 holds B; w3 holds nothing. Every copy verified."""
    t = now()
    with session_scope(settings.db_url) as s:
        for wid, port in (("w1", 1), ("w2", 2), ("w3", 3)):
            s.add(StorageWorker(id=wid, url=f"http://127.0.0.1:{port}", source="static", state="up", zone="z1",
                                capacity_bytes=10**12, free_bytes=4 * 10**11, used_bytes=3_000 + 2 * 10**9,
                                last_seen=t - timedelta(seconds=5), last_error="slow disk" if wid == "w2" else None))
        s.add(Content(sha256=A, size=3_000, created_at=t, last_referenced_at=t))
        s.add(Content(sha256=B, size=2 * 10**9, created_at=t, last_referenced_at=t))
        s.flush()
        for sha, wid in ((A, "w1"), (B, "w1"), (B, "w2")):
            s.add(ContentCopy(sha256=sha, worker_id=wid, state="verified", stored_at=t, verified_at=t))


def ckpt(settings, capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["--home", str(settings.home), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def home(settings):
    upgrade(settings.db_url)
    cluster_rows(settings)
    return settings


def state_of(settings, wid: str) -> str | None:
    with session_scope(settings.db_url) as s:
        return s.scalar(select(StorageWorker.state).where(StorageWorker.id == wid))


def test_the_list_shows_each_worker_in_human_units(home, capsys):
    rc, out, _ = ckpt(home, capsys, "workers")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "STATE", "ZONE", "USED", "FREE", "COPIES", "LAST", "SEEN", "URL"]
    w1 = next(line for line in lines if line.startswith("w1 "))
    assert w1.split() == ["w1", "up", "z1", "2.0", "GB", "400.0", "GB", "2", "5", "s", "ago", "http://127.0.0.1:1"]
    assert "last error: slow disk" in lines[lines.index(next(x for x in lines if x.startswith("w2 "))) + 1]
    assert next(line for line in lines if line.startswith("w3 ")).split()[7] == "0"  # copies held


def test_an_unknown_worker_says_where_the_ids_are(home, capsys):
    for action in ("drain", "undrain", "remove"):
        rc, _, err = ckpt(home, capsys, "workers", action, "w-xyz")
        assert rc == 1 and "no worker w-xyz; `ckpt workers` lists them" in err, err


def test_removing_the_only_good_copy_is_refused_with_what_to_do(home, capsys):
    rc, _, err = ckpt(home, capsys, "workers", "remove", "w1")
    assert rc == 1
    assert "w1 (up) holds the only good copy of 1 content(s) (3.0 kB)" in err, err
    assert "drain it first: `ckpt workers drain w1 --wait`" in err
    assert state_of(home, "w1") == "up"
    with session_scope(home.db_url) as s:  # nothing went
        assert s.scalar(select(ContentCopy.id).where(ContentCopy.worker_id == "w1").limit(1)) is not None


def test_removing_a_worker_whose_contents_are_elsewhere_forgets_it(home, capsys):
    rc, out, err = ckpt(home, capsys, "workers", "remove", "w3")  # holds nothing; nothing answers at its URL
    assert rc == 0, err
    assert "storage worker w3 (up, http://127.0.0.1:3) removed" in out
    assert state_of(home, "w3") is None
    rc, out, err = ckpt(home, capsys, "workers", "remove", "w2")  # B is on w1 too: one good copy left
    assert rc == 0, err
    assert "1 content(s) have fewer than 2 good copies without it: the scheduler's repair copies them" in out
    with session_scope(home.db_url) as s:
        assert s.scalars(select(ContentCopy.worker_id).where(ContentCopy.sha256 == B)).all() == ["w1"]


def test_a_worker_that_still_answers_is_not_removed(home):
    with pytest.raises(CkptError, match=r"w3 still answers at http://127.0.0.1:3: stop it first"):
        operations.remove(home, "w3", answers=lambda url, node: True)
    assert state_of(home, "w3") == "up"


def test_drain_then_undrain(home, capsys):
    rc, out, _ = ckpt(home, capsys, "workers", "drain", "w1")
    assert rc == 0 and "storage worker w1 is draining" in out and state_of(home, "w1") == "draining"
    p = operations.drain_progress(home, "w1")
    assert (p.state, p.held, p.left, p.left_bytes) == ("draining", 2, 2, 2 * 10**9 + 3_000)
    rc, out, _ = ckpt(home, capsys, "workers", "undrain", "w1")
    # back through 'down': its next good probe reconciles it before its copies count again
    assert rc == 0 and "no longer draining" in out and state_of(home, "w1") == "down"
    rc, _, err = ckpt(home, capsys, "workers", "undrain", "w1")
    assert rc == 1 and "w1 is down, not draining: nothing to undrain" in err


def test_drain_wait_shows_what_is_left_and_ctrl_c_leaves_it_draining(home):
    """No scheduler runs here, so the drain never ends: Ctrl-C stops the waiting, not the drain."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--home", str(home.home), "workers", "drain",
                             "w1", "--wait"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert "w1 is draining" in first, first + proc.stderr.read()
        progress = proc.stdout.readline()
        assert f"w1: 2 of 2 content(s) ({human_bytes(2 * 10**9 + 3_000)}) still to copy elsewhere" in progress
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert "stopped waiting: storage worker w1 is still draining" in err and "ckpt workers undrain w1" in err
    assert state_of(home, "w1") == "draining"


def test_sizes_are_human():
    assert [human_bytes(n) for n in (0, 1, 999, 1_000, 100_700_000, 2 * 10**9, 270_550_000_000, 3 * 10**12)] == [
        "0 bytes", "1 byte", "999 bytes", "1.0 kB", "100.7 MB", "2.0 GB", "270.6 GB", "3.0 TB"]
