"""Which processes load the planes codec ahead (pipeline/service/warmth.py)."""
from __future__ import annotations

import dataclasses

from pipeline.db.engine import session_scope
from pipeline.db.workers import add
from pipeline.service.warmth import frames_coming, worker_urls

REMOTE, LOCAL = "http://10.1.2.3:7070", "http://127.0.0.1:7070"


def test_frames_come_only_from_workers_on_other_hosts(settings):
    assert frames_coming(settings, [LOCAL, "http://localhost:7071", "http://[::1]:7072"]) is False
    assert frames_coming(settings, [LOCAL, REMOTE]) is True
    assert frames_coming(settings, [REMOTE.replace("10.1.2.3", "worker-3.lan")]) is True  # a name: another host
    assert frames_coming(settings, []) is False


def test_no_frames_when_the_wire_is_plain_or_zstd(settings):
    assert frames_coming(dataclasses.replace(settings, wire_compression="off"), [REMOTE]) is False
    assert frames_coming(dataclasses.replace(settings, wire_codec="zstd"), [REMOTE]) is False
    assert frames_coming(dataclasses.replace(settings, wire_compression="on"), [REMOTE]) is True


def test_the_known_workers_are_the_static_list_and_those_recorded(db):
    with session_scope(db.db_url) as s:
        add(s, "w-found", REMOTE, source="mdns")
    assert sorted(worker_urls(dataclasses.replace(db, workers=(LOCAL,)))) == sorted([LOCAL, REMOTE])


def test_without_a_control_plane_the_static_list_decides(settings):
    away = dataclasses.replace(settings, workers=(REMOTE,), database_url="sqlite:////nonexistent/dir/ckpt.db")
    assert worker_urls(away) == [REMOTE]
