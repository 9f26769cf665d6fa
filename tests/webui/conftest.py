"""Web UI fixtures: the Flask app on a temporary control plane (``web_settings``, in
tests/conftest.py, with the session's embedded Redis) and rows to show."""
from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline import settings as settings_mod
from pipeline.core import placement
from pipeline.db import hosts
from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy, Job, QueueConsumer, StorageWorker
from pipeline.db.transitions import create_job, now, transition
from pipeline.detection import catalog, completeness, roots
from pipeline.queues import host_queue
from tests.checkpoints import atomic_save, state_dict


@pytest.fixture
def app(web_settings):
    from webui import create_app

    return create_app({"TESTING": True}, settings=web_settings)


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def token(web_settings) -> str:
    return web_settings.admin_token()


@pytest.fixture
def admin(client, token):
    """A client logged in through the login form."""
    page = client.get("/login").get_data(as_text=True)
    client.post("/login", data={"token": token, "csrf_token": csrf_of(page)})
    return client


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)


def seed(s: settings_mod.Settings, step: int = 1) -> dict:
    """A verified checkpoint on two workers, plus a restore job that finished: real files, real rows."""
    path = atomic_save(state_dict(step), Path(s.roots[0].rstrip("*")) / "r1" / f"step_{step}.safetensors")
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as session:
        for i in range(2 if session.get(StorageWorker, "w-0") is None else 0):
            session.add(StorageWorker(id=f"w-{i}", url=f"http://127.0.0.1:{7000 + i}", source="static", state="up",
                                      free_bytes=10**10, capacity_bytes=2 * 10**10, last_seen=now()))
        ckpt, job, _ = catalog.record(session, detected, lease_seconds=60, detail="seeded")
        t = now()
        for sh in ckpt.files[0].shards:
            two = [placement.Candidate("w-0", 10**10), placement.Candidate("w-1", 10**10)]
            for w in placement.place(sh.sha256, two, 2):
                if not any(c.worker_id == w for c in sh.content.copies):
                    sh.content.copies.append(ContentCopy(worker_id=w, state="verified", stored_at=t, verified_at=t,
                                                         checked_at=t, attempts=0))
        session.flush()
        for a, b in (("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")):
            transition(session, job.id, "store", a, b, detail=f"seeded {b}")
        hosts.report_in(session, s.host_id, s.host_label, consumer=True)  # this host's Dramatiq runs restores
        restore = create_job(session, "restore", checkpoint_id=ckpt.id, params={"dest": "/tmp/x"})
        for a, b in (("queued", "gathering"), ("gathering", "verified"), ("verified", "done")):
            transition(session, restore.id, "restore", a, b)
        ids = {"checkpoint": ckpt.id, "store_job": job.id, "restore_job": restore.id, "path": str(path)}
    return ids


def one_job(s, kind: str) -> Job:
    with session_scope(s.db_url) as session:
        return session.scalars(select(Job).where(Job.kind == kind).order_by(Job.id.desc())).first()



def consumer(s, host: str, *, seconds_ago: float = 0.0) -> None:
    """Host ``host`` as its Dramatiq worker processes report it (pipeline/tasks/middleware.py)."""
    with session_scope(s.db_url) as session:
        hosts.report_in(session, host, f"{host}.example", consumer=True)
        session.flush()
        session.get(QueueConsumer, host_queue(host)).seen_at = now() - timedelta(seconds=seconds_ago)

