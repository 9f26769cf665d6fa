"""Attack on issue 28 ("never wedged"): orders of events and peer answers no other test names."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time
from datetime import timedelta

from pipeline.cluster import membership
from pipeline.db.migrate import upgrade
from tests.bad_peers import _head, serving


def _drip(conn: socket.socket, stop: threading.Event) -> None:
    """An HTTP answer that never ends: one byte of its declared body every 0.2 s, so no
    single receive ever waits as long as the probe's timeout."""
    _head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.2):
        conn.sendall(b"x")


def test_a_peer_that_drips_its_answer_does_not_hold_up_the_probe_of_every_worker(settings):
    """CKPT_PROBE_SECONDS bounds each receive, not the exchange: a stranger on a worker's port
    that drips a byte every 0.2 s keeps probe_all (and with it the scheduler's whole tick:
    re-drives, rotation, repair) from returning, and no other worker's answer is recorded."""
    upgrade(settings.db_url)
    with serving(_drip) as url:
        s = dataclasses.replace(settings, probe_seconds=0.5, workers=(url, "http://127.0.0.1:1"))
        done: list[membership.ProbeResult] = []
        t = threading.Thread(target=lambda: done.append(membership.probe_all(s)), daemon=True)
        started = time.monotonic()
        t.start()
        t.join(6)
        took = time.monotonic() - started
    t.join(30)
    assert took < 6, f"probe_all took {took:.1f} s with CKPT_PROBE_SECONDS=0.5: one dripping peer wedged it"


# -- at most one outstanding message per step ----------------------------------------------

import pytest  # noqa: E402
from dramatiq import Message  # noqa: E402

from pipeline import settings as settings_mod  # noqa: E402
from pipeline.db.engine import session_scope  # noqa: E402
from pipeline.db.models import Checkpoint, ContentCopy, Job, StorageWorker  # noqa: E402
from pipeline.db.transitions import create_job, now, transition  # noqa: E402
from pipeline.detection import catalog, completeness, roots  # noqa: E402
from pipeline.steps import Send  # noqa: E402
from tests.conftest import broker_for  # noqa: E402


@pytest.fixture
def stub(db, process_broker):
    with broker_for(dataclasses.replace(db, redis_url="stub://")) as b:
        yield b


def _all_queued(broker) -> list[Message]:
    return [Message.decode(body) for q in broker.queues.values() for body in list(q.queue)]


def test_one_batch_naming_a_step_twice_queues_one_message(db, stub):
    """send_all reads every row's key before it records any: a batch holding the same keyed
    step twice records two fresh keys (the first overwritten) and enqueues both."""
    from pipeline.tasks.sending import send_all

    with session_scope(db.db_url) as s:
        job_id = create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "w1"}).id
    send_all([Send("scrub", (job_id,)), Send("scrub", (job_id,))])
    assert len(_all_queued(stub)) == 1, [m.message_id for m in _all_queued(stub)]


def _record(s, path, host="node-a"):
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as ses:
        ckpt, job, _created = catalog.record(ses, detected, lease_seconds=60, detail="test", host=host)
        transition(ses, job.id, "store", "detected", "sharded")
        return ckpt.id, job.id


def test_a_re_drive_of_two_stores_sharing_content_queues_one_message_per_copy(db, stub, tmp_path):
    """Two saves with the same bytes (a fine-tune's frozen layers, one model saved in two runs)
    share their contents and so their pending copies. When both stores' leases end in one tick,
    expired_work resumes each with replicate(copy) for every pending copy of its contents: the
    same copy twice in one batch, so two messages per copy per re-drive (N stores: N)."""
    from pipeline.service.scheduler import expired_work
    from pipeline.tasks.sending import send_all
    from tests.checkpoints import atomic_save, state_dict

    s = settings_mod.configure(dataclasses.replace(db, rf=1))
    for run in ("r1", "r2"):
        (tmp_path / "runs" / run).mkdir()
    a = atomic_save(state_dict(7), tmp_path / "runs" / "r1" / "step_1.safetensors")
    b = atomic_save(state_dict(7), tmp_path / "runs" / "r2" / "step_1.safetensors")
    (ca, ja), (cb, jb) = _record(s, a), _record(s, b)
    with session_scope(s.db_url) as ses:
        ses.add(StorageWorker(id="w1", url="http://127.0.0.1:1", source="static", state="up", last_seen=now()))
        ses.flush()
        shas = {sh.sha256 for f in ses.get(Checkpoint, ca).files for sh in f.shards}
        assert shas == {sh.sha256 for f in ses.get(Checkpoint, cb).files for sh in f.shards}
        for sha in sorted(shas):
            ses.add(ContentCopy(sha256=sha, worker_id="w1", state="pending", attempts=0))
        for j in (ja, jb):
            ses.get(Job, j).lease_until = now() - timedelta(seconds=5)
    send_all(expired_work(s))
    per_copy: dict[int, int] = {}
    for m in _all_queued(stub):
        if m.actor_name == "replicate":
            per_copy[m.args[0]] = per_copy.get(m.args[0], 0) + 1
    assert per_copy and max(per_copy.values()) == 1, per_copy


# -- a stranger's one answer undoes an operator's drain -------------------------------------

def _header(head: bytes, name: str) -> str:
    for line in head.split(b"\r\n"):
        k, _, v = line.partition(b":")
        if k.strip().lower() == name.lower().encode():
            return v.strip().decode()
    return ""


def _stranger_then_genuine(settings, start: str):
    """A worker row in ``start``; one probe answered 403 by a stranger at its URL, then one
    answered by the real worker: its state after, and the second probe's result."""
    import json

    from pipeline.cluster import auth
    from pipeline.db.models import StorageWorker
    from tests.bad_peers import request_id

    upgrade(settings.db_url)
    key, node = settings.key(), "w-00000000000d"
    mode = ["stranger"]

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        head = _head(conn)
        if mode[0] == "stranger":
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        doc = {"node_id": node, "capacity": 10**12, "free": 10**12, "used": 0,
               "proof": auth.proof(key, node, _header(head, auth.URL_HEADER), _header(head, auth.NONCE_HEADER))}
        body = json.dumps(doc).encode()
        headers = auth.sign_response(key, node, request_id(head), 200, auth.body_digest(body))
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n".encode()
                     + "".join(f"{k}: {v}\r\n" for k, v in headers).encode() + b"\r\n" + body)

    with serving(answer) as url:
        with session_scope(settings.db_url) as s:
            s.add(StorageWorker(id=node, url=url, source="static", state=start, last_seen=now()))
        membership.probe_all(settings)
        mode[0] = "genuine"
        back = membership.probe_all(settings)
    with session_scope(settings.db_url, readonly=True) as s:
        state = s.get(StorageWorker, node).state
    return state, back


def test_one_stranger_answer_at_a_draining_workers_url_cancels_the_drain(settings):
    """A draining worker (an operator's decision, which a probe never overrides) whose port
    answers one probe with a 403 (another service bound it during a restart) becomes
    'rejected'; the next probe of the real worker admits it 'up' from there: the drain is gone,
    the worker takes new copies, and nothing says so. Same from 'removable'."""
    state, _ = _stranger_then_genuine(settings, "draining")
    assert state == "draining", f"the operator's drain became {state!r} after one stranger answer"


def test_a_worker_back_from_rejected_is_reconciled_before_its_copies_count(settings):
    """'up' -> 'rejected' (one 403 from whatever held its port) -> 'up': its copies, uncounted
    meanwhile, count again at once; unlike a return from 'down', no reconcile is asked
    (ProbeResult.returned names only workers that were 'down')."""
    state, back = _stranger_then_genuine(settings, "up")
    assert state == "up"
    assert back.returned == ["w-00000000000d"], "came back from rejected without a reconcile"
