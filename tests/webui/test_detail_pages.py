"""Detail pages that act: a checkpoint restores from its page (destination checked before and on
submit, a refusal shown in that form with what was typed), shows how to load it and its other
versions; a job's numbers mean what they say; a worker says why it is not used and can be
drained; times are ISO 8601."""
from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update

from pipeline.db.engine import session_scope
from pipeline.db.models import Job, JobEvent, StorageWorker
from pipeline.db.transitions import now
from pipeline.detection import catalog, completeness, roots
from tests.checkpoints import atomic_save, state_dict
from tests.webui.conftest import consumer, csrf_of, one_job, seed

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def test_restore_from_the_checkpoint_page_checks_the_destination(admin, web_settings, tmp_path):
    ids = seed(web_settings)
    page = admin.get(f"/checkpoints/{ids['checkpoint']}").get_data(as_text=True)
    assert 'id="restore-form"' in page and f"pipeline.restore({ids['checkpoint']}" in page
    assert f"pipeline.load_state_dict({ids['checkpoint']})" in page
    check = f"/checkpoints/{ids['checkpoint']}/restore-check"
    bad = admin.get(check, query_string={"dest": "/etc/passwd-restored"}).get_json()
    assert bad["ok"] is False and "outside the restore roots" in bad["error"]
    existing = tmp_path / "runs" / "taken"
    existing.mkdir()
    assert "exists" in admin.get(check, query_string={"dest": str(existing)}).get_json()["error"]
    run_dir = admin.get(check, query_string={"dest": str(existing), "overwrite": "1"}).get_json()
    assert run_dir["ok"] is False and "an overwrite never removes a run" in run_dir["error"]
    settled = time.time() - 10  # saved longer ago than the settle time
    os.utime(ids["path"], (settled, settled))
    protected = admin.get(check, query_string={"dest": ids["path"], "overwrite": "1"}).get_json()
    assert protected == {"ok": True, "target": ids["path"]}  # a protected checkpoint's own files, unchanged
    good = admin.get(check, query_string={"dest": str(tmp_path / "runs" / "back")}).get_json()
    assert good == {"ok": True, "target": str(tmp_path / "runs" / "back")}
    assert one_job(web_settings, "restore").id == ids["restore_job"]  # checking created nothing

    token = csrf_of(page)
    r = admin.post(f"/checkpoints/{ids['checkpoint']}/restore", data={"dest": "/etc/nope", "csrf_token": token})
    html = r.get_data(as_text=True)
    assert r.status_code == 400 and "outside the restore roots" in html and 'value="/etc/nope"' in html
    r = admin.post(f"/checkpoints/{ids['checkpoint']}/restore",
                   data={"dest": str(tmp_path / "runs" / "back"), "csrf_token": token})
    job = one_job(web_settings, "restore")
    assert r.status_code == 303 and r.headers["Location"] == f"/jobs/{job.id}"
    assert job.params["dest"] == str(tmp_path / "runs" / "back")


def test_a_refused_restore_from_the_actions_form_keeps_what_was_typed(admin, web_settings, tmp_path):
    ids = seed(web_settings)
    existing = tmp_path / "runs" / "taken"
    existing.mkdir()
    token = csrf_of(admin.get("/actions").get_data(as_text=True))
    r = admin.post("/actions/restore", data={"checkpoint": ids["checkpoint"], "dest": str(existing),
                                             "csrf_token": token})
    html = r.get_data(as_text=True)
    assert r.status_code == 409 and 'id="restore-error"' in html and "overwrite" in html
    assert f'value="{existing}"' in html


def test_versions_at_the_same_path_are_linked(client, web_settings):
    first = seed(web_settings)
    path = atomic_save(state_dict(99), Path(first["path"]))  # new bytes at the same path: a second version
    run, ckpt_path = roots.locate(path, web_settings.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path),
                                       shard_size=web_settings.shard_size)
    with session_scope(web_settings.db_url) as s:
        second = catalog.record(s, detected, lease_seconds=60, detail="test")[0].id
    page = client.get(f"/checkpoints/{second}").get_data(as_text=True)
    assert 'id="versions"' in page and f'href="/checkpoints/{first["checkpoint"]}"' in page
    assert "(current)" in page and "superseded" in page


def test_job_numbers_stop_with_the_work_and_say_what_they_count(client, web_settings):
    ids = seed(web_settings)
    with session_scope(web_settings.db_url) as s:  # the store verified an hour ago, after 2 s of work
        t0 = now() - timedelta(hours=1)
        s.execute(update(Job).where(Job.id == ids["store_job"]).values(created_at=t0))
        s.execute(update(JobEvent).where(JobEvent.job_id == ids["store_job"]).values(at=t0 + timedelta(seconds=2)))
        s.execute(update(Job).where(Job.id == ids["restore_job"]).values(attempts=1))
    store = client.get(f"/jobs/{ids['store_job']}").get_data(as_text=True)
    assert "took 2.0 s" in store and "copies sent" in store and "the checkpoint is" in store
    jobs = client.get("/jobs").get_data(as_text=True)
    assert "2.0 s" in jobs and "step_1.safetensors</a>" in jobs
    assert '<select name="state">' in jobs and "<option >verified</option>" in jobs.replace("<option>", "<option >")


def test_attempts_are_kept_once_a_job_rests(web_settings):
    from pipeline.db.transitions import create_job, start_attempt, transition

    with session_scope(web_settings.db_url) as s:
        job = create_job(s, "restore", checkpoint_id=None, params={"dest": "/x"})
        transition(s, job.id, "restore", "queued", "gathering")
        start_attempt(s, job.id, "gathering", 60)
        start_attempt(s, job.id, "gathering", 60)
        transition(s, job.id, "restore", "gathering", "verified")
        assert s.get(Job, job.id, populate_existing=True).attempts == 0  # a new step starts at zero
        start_attempt(s, job.id, "verified", 60)
        transition(s, job.id, "restore", "verified", "done")
        assert s.get(Job, job.id, populate_existing=True).attempts == 1  # what its last step took


def test_times_are_iso_8601_in_the_api_and_in_the_browsers_zone_on_pages(client, web_settings):
    ids = seed(web_settings)
    doc = client.get(f"/api/jobs/{ids['store_job']}").get_json()
    assert ISO.match(doc["created_at"]) and ISO.match(doc["timeline"][0]["at"])
    page = client.get(f"/jobs/{ids['store_job']}").get_data(as_text=True)
    assert re.search(r'<time datetime="\d{4}-\d\d-\d\dT[^"]+Z">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</time>', page)


def test_workers_say_why_and_can_be_drained(admin, web_settings):
    seed(web_settings)
    with session_scope(web_settings.db_url) as s:
        s.add(StorageWorker(id="w-stranger", url="http://10.0.0.9:7000", source="mdns", state="rejected",
                            last_error="failed the admission challenge: wrong cluster key"))
    page = admin.get("/workers").get_data(as_text=True)
    assert "failed the admission challenge" in page and "<meter" in page and "not reported" in page
    token = csrf_of(page)
    r = admin.post("/workers/w-1/drain", data={"csrf_token": token})
    assert r.status_code == 303
    with session_scope(web_settings.db_url) as s:
        assert s.get(StorageWorker, "w-1").state == "draining"


def test_the_restore_forms_offer_the_hosts_with_a_consumer_and_restore_there(admin, web_settings, tmp_path):
    import dramatiq

    from pipeline.queues import host_queue

    ids = seed(web_settings)
    consumer(web_settings, "h2")
    consumer(web_settings, "h-gone", seconds_ago=600)
    page = admin.get(f"/checkpoints/{ids['checkpoint']}").get_data(as_text=True)
    offered = re.findall(r'<option value="([^"]+)"[^>]*>', page.split('name="host"')[1].split("</select>")[0])
    assert sorted(offered) == sorted(["h2", web_settings.host_id])  # not the host whose consumer is gone
    assert re.search(rf'<option value="{re.escape(web_settings.host_id)}" selected', page)  # the checkpoint's host
    assert "h2 (h2.example)" in page  # the id, then its hostname as label
    check = f"/checkpoints/{ids['checkpoint']}/restore-check"
    gone = admin.get(check, query_string={"dest": "/data/x", "host": "h-gone"}).get_json()
    assert gone["ok"] is False and "no Dramatiq worker consumes host h-gone's queue" in gone["error"]
    assert admin.get(check, query_string={"dest": "/data/x", "host": "h2"}).get_json() == {"ok": True,
                                                                                         "target": "/data/x"}
    r = admin.post(f"/checkpoints/{ids['checkpoint']}/restore",
                   data={"dest": "/data/x", "host": "h2", "csrf_token": csrf_of(page)})
    job = one_job(web_settings, "restore")
    assert r.status_code == 303 and job.params["host"] == "h2"
    assert dramatiq.get_broker().client.llen(f"dramatiq:{host_queue('h2')}") == 1
    actions = admin.get("/actions").get_data(as_text=True)
    r = admin.post("/actions/restore", data={"checkpoint": ids["checkpoint"], "dest": "/data/y", "host": "h-gone",
                                             "csrf_token": csrf_of(actions)})
    assert r.status_code == 409 and b"h-gone" in r.data and b'value="/data/y"' in r.data
