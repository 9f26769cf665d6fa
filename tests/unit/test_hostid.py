"""A host is its id kept beside the home, not its hostname (pipeline/hostid.py).

Given a home whose checkpoints were recorded under hostname A, When the processes of that
home start again under hostname B (a container restart, the home moved), Then nothing is
detected again, no store job is created, and the host's steps still go to A's queue; the new
hostname is only the label shown beside the id.
"""
from __future__ import annotations

import dataclasses
import socket

import pytest
from sqlalchemy import func, select

from pipeline import hostid
from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Checkpoint, Job, TrainingHost
from pipeline.db.transitions import create_job
from pipeline.detection.watcher import Watcher
from pipeline.errors import ConfigError
from pipeline.queues import host_queue, queues_for
from pipeline.steps import Send
from tests.checkpoints import atomic_save, hf_folder, state_dict


def test_a_home_moved_to_a_new_hostname_keeps_its_checkpoints_and_its_queue(db, tmp_path, monkeypatch):
    settings = dataclasses.replace(db, quiet_seconds=0.0)
    settings.home.mkdir(exist_ok=True)  # with PostgreSQL the home holds no database, still the host's id
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    atomic_save(state_dict(1), run / "step_1.safetensors")
    hf_folder(run / "checkpoint-2", seed=2)
    monkeypatch.setattr(socket, "gethostname", lambda: "host-a")
    Watcher(settings, [].extend, use_events=False).scan()
    # A home from before ids were kept: its rows name the hostname and it has no host-id yet.
    (settings.home / hostid.FILE).unlink(missing_ok=True)
    assert settings.host_id == "host-a"  # the first start writes the hostname the rows were recorded under
    assert (settings.home / hostid.FILE).read_text().strip() == "host-a"
    with session_scope(settings.db_url) as s:
        before = sorted(s.execute(select(Checkpoint.id, Checkpoint.host, Checkpoint.path)).all())
        jobs = s.scalar(select(func.count()).select_from(Job))
    assert {h for _i, h, _p in before} == {"host-a"} and len(before) == 2

    monkeypatch.setattr(socket, "gethostname", lambda: "host-b")
    sends: list[Send] = []
    watcher = Watcher(settings, sends.extend, use_events=False)
    watcher.scan()
    watcher.scan()

    with session_scope(settings.db_url) as s:
        assert sorted(s.execute(select(Checkpoint.id, Checkpoint.host, Checkpoint.path)).all()) == before
        assert s.scalar(select(func.count()).select_from(Job)) == jobs, "the same files were recorded again"
        job_id = s.scalar(select(Job.id).where(Job.kind == "store").limit(1))
        assert queues_for(s, Send("shard", (job_id,))) == [host_queue("host-a")]
        host = s.get(TrainingHost, "host-a")
        assert host is not None and host.label == "host-b"
        assert s.get(TrainingHost, "host-b") is None
    assert not [x for x in sends if x.actor == "shard"]
    assert settings.host_id == "host-a" and settings.host_label == "host-b"


def test_the_id_is_written_once_with_the_hostname_and_kept(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr(socket, "gethostname", lambda: "first")
    assert hostid.host_id(home) == "first"
    monkeypatch.setattr(socket, "gethostname", lambda: "second")
    assert hostid.host_id(home) == "first" and hostid.label() == "second"
    (home / hostid.FILE).write_text("chosen-by-hand\n")  # an operator may name the host
    assert hostid.host_id(home) == "chosen-by-hand"


def test_ckpt_host_wins_and_no_home_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    home = tmp_path / "home"
    home.mkdir()
    s = settings_mod.load({"home": home}, environ={"CKPT_HOST": "h7"})
    assert s.host_id == "h7" and not (home / hostid.FILE).exists()
    absent = tmp_path / "nowhere"
    assert hostid.host_id(absent) == "box" and not absent.exists()


@pytest.mark.parametrize("text", ["", "\n", "a\nb\n", "x" * 300])
def test_a_broken_host_id_file_says_what_to_do(tmp_path, text):
    home = tmp_path / "home"
    home.mkdir()
    (home / hostid.FILE).write_text(text)
    with pytest.raises(ConfigError, match="host-id must hold this host's id on one line"):
        hostid.host_id(home)


def test_two_host_ids_never_share_a_queue(settings):
    """hostid accepts any id of up to 255 characters on one line (CKPT_HOST or host-id); host_queue
    folded every character outside [A-Za-z0-9_.-] to '_' and cut at 100: 'gpu node 1' and
    'gpu_node_1' consumed one queue. A shard, rotate or restore for one, taken by the other,
    finds itself on the wrong host and sends itself again to the same queue: with the first
    host down, the second bounced it forever (no attempt counted: owner_elsewhere and the
    restore's host check come before begin_step), and require_consumer took the second's beat
    for the first's."""
    from pipeline.restoring import job as restore_job

    upgrade(settings.db_url)
    s = dataclasses.replace(settings, host="gpu_node_1")
    with session_scope(s.db_url) as ses:
        j = create_job(ses, "restore", checkpoint_id=None, params={"dest": "/x", "host": "gpu node 1"}).id
    bounced = restore_job.restore(s, j)  # runs on gpu_node_1: not its host, sent again...
    assert bounced == [Send("restore", (j,))]
    assert host_queue("gpu node 1") != host_queue(s.host_id), "...to the queue it was taken from"

def test_plain_ids_keep_their_queue_and_no_two_ids_share_one(tmp_path, caplog):
    import re

    plain = ["node-a", "gpu_node_1", "h7.example.org", "x" * 100]
    assert [host_queue(h) for h in plain] == [f"ckpt.host.{h}" for h in plain]  # deployed queues stay
    odd = ["gpu node 1", "gpu_node_1..", "a..b", "x" * 101, "x" * 102, "gpu/node/1", "gpu\tnode 1", "ñode",
           "gpu_node_1.." + hostid.in_queue("gpu node 1").rpartition("..")[2]]
    queues = [host_queue(h) for h in plain + odd]
    assert len(set(queues)) == len(queues), queues
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]{1,110}", q) for q in queues)  # a Dramatiq queue name, a Redis key
    assert host_queue("gpu node 1").startswith("ckpt.host.gpu_node_1..")  # still readable
    with caplog.at_level("WARNING", logger="ckpt.hostid"):
        for _ in range(2):
            assert hostid.host_id(tmp_path, "rack 4 node 2") == "rack 4 node 2"  # CKPT_HOST: kept as it is
            assert hostid.host_id(tmp_path, "rack-4-node-3") == "rack-4-node-3"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said  # once per process, for the id that is not plain only
    assert "'rack 4 node 2' (CKPT_HOST)" in said[0] and host_queue("rack 4 node 2") in said[0], said


def test_two_machines_reporting_under_one_id_are_named_in_the_log(db, caplog):
    """A home copied to make a second host carries its host-id: both then act as one host.
    The control plane cannot tell which is right, but says so when it sees it."""
    from pipeline.db import hosts

    with session_scope(db.db_url) as s:
        hosts.report_in(s, "h1", "box-a", consumer=True)
    with session_scope(db.db_url) as s:
        hosts.report_in(s, "h1", "box-a")  # the same machine again: nothing to say
    assert "share one host id" not in caplog.text
    with session_scope(db.db_url) as s:
        hosts.report_in(s, "h1", "box-b")
    assert "host h1 reports from hostname box-b seconds after box-a did" in caplog.text
