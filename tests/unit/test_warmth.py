"""Which processes load the planes codec ahead (pipeline/service/warmth.py)."""
from __future__ import annotations

import dataclasses

from pipeline.cluster.wire import is_loopback, own_address
from pipeline.db.engine import session_scope
from pipeline.db.workers import add, observe
from pipeline.service import warmth
from pipeline.service.warmth import elsewhere, frames_coming, recorded_urls

REMOTE, LOCAL = "http://10.1.2.3:7070", "http://127.0.0.1:7070"


def test_a_worker_is_elsewhere_unless_on_loopback_or_at_an_address_of_this_host(monkeypatch):
    assert not elsewhere(LOCAL) and not elsewhere("http://localhost:7071") and not elsewhere("http://[::1]:7072")
    # as a dual-stack socket sees a loopback IPv4 client
    assert not elsewhere("http://[::ffff:127.0.0.1]:7073") and is_loopback("::ffff:127.0.0.1")
    assert elsewhere(REMOTE) and elsewhere("http://worker-3.lan:7070")  # a name: another host, not looked up
    # A one-host cluster addressed by its LAN address: an address this host binds is this host.
    monkeypatch.setattr(warmth, "own_address", lambda host: host == "10.1.2.3")
    assert not elsewhere(REMOTE) and elsewhere("http://10.1.2.4:7070")


def test_own_address_is_what_this_host_can_bind():
    assert own_address("127.0.0.1") and own_address("localhost")
    assert not own_address("192.0.2.1")  # TEST-NET-1: documentation only, never assigned to a host
    assert not own_address("0.0.0.0") and not own_address("::")  # every address, none in particular


def test_frames_come_from_the_static_list_or_the_recorded_workers(settings):
    assert frames_coming(settings, [LOCAL]) is False
    assert frames_coming(settings, [LOCAL, REMOTE]) is True
    assert frames_coming(dataclasses.replace(settings, workers=(REMOTE,)), []) is True
    assert frames_coming(dataclasses.replace(settings, workers=(LOCAL,)), []) is False


def test_no_frames_when_the_wire_is_plain_or_zstd(settings):
    assert frames_coming(dataclasses.replace(settings, wire_compression="off"), [REMOTE]) is False
    assert frames_coming(dataclasses.replace(settings, wire_codec="zstd"), [REMOTE]) is False
    assert frames_coming(dataclasses.replace(settings, wire_compression="on"), [REMOTE]) is True


def test_the_recorded_workers_are_those_up_or_full(db):
    with session_scope(db.db_url) as s:
        observe(s, add(s, "w-up", REMOTE, source="mdns"), "up")
        observe(s, add(s, "w-down", "http://10.9.9.9:7070", source="mdns"), "down")
    assert recorded_urls(db) == [REMOTE]


def test_a_control_plane_without_its_schema_records_none(settings, tmp_path):
    empty = dataclasses.replace(settings, database_url=f"sqlite:///{tmp_path / 'empty.db'}")
    assert recorded_urls(empty) == []
    assert frames_coming(dataclasses.replace(empty, workers=(REMOTE,))) is True
    assert frames_coming(dataclasses.replace(empty, workers=(LOCAL,))) is False
