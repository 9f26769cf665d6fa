"""Hostile peers, run by test_hostile_peers.py inside a private network namespace.

Two real storage workers on 127.0.0.1, and on other loopback addresses of the namespace: a
relay (forwards every connection to the first worker), a rogue that answers like a worker
without holding the key (uploads "created", re-hashes "match", sizes "held", storing nothing),
a candidate answering garbage (a non-ASCII proof, a number for a node id, text for sizes) and
one answering something that is not JSON. The real control-plane code runs against them:
probes, the rotation's confirmation, a replayed DELETE, a worker coming back under a new node
id, a scheduler tick. Prints one JSON document with what happened.
"""
from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import os
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.multihost.forward import pump
from tests.processes import KEY, StorageWorker, base_env


def relay(listen: tuple[str, int], target: tuple[str, int]) -> str:
    """A TCP relay (a rogue that forwards what it gets to a real worker); its URL."""
    server = socket.create_server(listen)

    def accept() -> None:
        while True:
            client, _ = server.accept()
            upstream = socket.create_connection(target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://{listen[0]}:{listen[1]}"


def fake_worker(listen: tuple[str, int], status: Any) -> str:
    """An HTTP server that answers like a storage worker without the key: ``status`` for a
    status probe, "created" for any upload, the right hash for any re-hash, "held" for any stat."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, code: int, doc: Any) -> None:
            body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _names(self) -> list[str]:
            doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            return list(doc.get("shards") or [])

        def do_GET(self) -> None:
            self._send(200, status)

        def do_PUT(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)  # and throw it away
            name = self.path.rsplit("/", 1)[-1]
            self._send(201, {"name": name, "size": n, "created": True, "already_present": False})

        def do_POST(self) -> None:
            names = self._names()
            if self.path == "/v1/verify":
                self._send(200, {"results": [{"name": n, "sha256": n, "size": 1} for n in names]})
            elif self.path == "/v1/stat":
                self._send(200, {"sizes": {n: 1 << 20 for n in names}})
            else:
                self._send(200, {})

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(listen, Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{listen[0]}:{listen[1]}"


def main(tmp: Path) -> dict:
    from sqlalchemy import select

    from pipeline import settings as settings_mod
    from pipeline.cluster import auth
    from pipeline.cluster.client import WorkerClient
    from pipeline.cluster.membership import probe_all
    from pipeline.db.engine import session_scope
    from pipeline.db.migrate import upgrade
    from pipeline.db.models import Checkpoint, ContentCopy, Job
    from pipeline.db.models import StorageWorker as Row
    from pipeline.db.transitions import create_job, now, transition
    from pipeline.detection import catalog, completeness, roots
    from pipeline.errors import UntrustedAnswer
    from pipeline.service.scheduler import Scheduler
    from pipeline.store.rotation import confirm_with_workers
    from pipeline.store.source import local_source, shard_prefix
    from tests.checkpoints import atomic_save, state_dict

    out: dict[str, Any] = {}
    w1 = StorageWorker(tmp / "w1", base_env(tmp / "h1"), tmp / "w1.log").start()
    w2 = StorageWorker(tmp / "w2", base_env(tmp / "h2"), tmp / "w2.log").start()
    try:
        relay_url = relay(("127.0.0.2", w1.port), ("127.0.0.1", w1.port))
        rogue_url = fake_worker(("127.0.0.3", 7100), {"node_id": "w-rogue0000000", "capacity": 10**12,
                                                       "free": 10**12, "used": 0, "proof": "0" * 64})
        garbage_url = fake_worker(("127.0.0.4", 7100), {"node_id": 12, "proof": "\u00e9" * 64, "capacity": "lots"})
        not_json_url = fake_worker(("127.0.0.5", 7100), b"hello, I am a printer")
        (tmp / "runs" / "r").mkdir(parents=True)
        s = settings_mod.configure(settings_mod.load({
            "home": tmp / "home", "roots": (str(tmp / "runs" / "*"),), "cluster_key": KEY, "redis_url": "stub://",
            "workers": (w1.url, w2.url, relay_url, rogue_url, garbage_url, not_json_url), "shard_size": 1 << 16,
        }, environ={}))
        upgrade(s.db_url)
        key = s.key()

        # 1. One probe of everyone: the real workers are admitted at their own URLs, nothing else is.
        probe = probe_all(s)

        def rows() -> dict[str, tuple[str, str]]:
            with session_scope(s.db_url) as ses:
                return {w.id: (w.url, w.state) for w in ses.scalars(select(Row))}

        out["probe_answers"] = probe.answers
        out["rows_after_probe"] = rows()
        probe_all(s)  # and again: the relay never moves the real worker's row
        out["rows_after_second_probe"] = rows()

        # 2. A rogue that got a row anyway (say, recorded by an older release): none of its
        # answers is believed, and a rotation counting its copy is refused.
        path = atomic_save(state_dict(3), tmp / "runs" / "r" / "step_1.safetensors")
        run, ckpt_path = roots.locate(path, s.roots)
        detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
        with session_scope(s.db_url) as ses:
            ses.add(Row(id="w-rogue0000000", url=rogue_url, source="static", state="up", last_seen=now()))
            ckpt, job, _ = catalog.record(ses, detected, lease_seconds=60, detail="hostile test")
            ckpt_id, job_id = ckpt.id, job.id
            shards = [(sh.sha256, sh.src_offset, sh.length, sh.size) for f in ckpt.files for sh in f.shards]
            sources = {sha: local_source(ses, sha, None) for sha, *_ in shards}
        rogue = WorkerClient(rogue_url, key, "w-rogue0000000")
        believed = {}
        for what, call in (("upload", lambda: rogue.put_range(shards[0][0], b"", str(path), 0, shards[0][2])),
                           ("rehash", lambda: rogue.verify([shards[0][0]])),
                           ("stat", lambda: rogue.stat([shards[0][0]])),
                           ("status", lambda: rogue.status())):
            try:
                call()
                believed[what] = True
            except UntrustedAnswer:
                believed[what] = False
        out["rogue_answers_believed"] = believed
        real1 = WorkerClient(w1.url, key, w1.node_id)
        real2 = WorkerClient(w2.url, key, w2.node_id)
        for sha, src in sources.items():  # the real copies, uploaded as the pipeline does
            assert src is not None
            for client in (real1, real2):
                client.put_range(sha, shard_prefix(src.path, src.kind, src.tensors), src.path, src.offset, src.length)
        t = now()
        with session_scope(s.db_url) as ses:
            for a, b in (("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")):
                transition(ses, job_id, "store", a, b)
            for sha, _o, _l, _size in shards:
                for wid in (w1.node_id, "w-rogue0000000"):
                    ses.add(ContentCopy(sha256=sha, worker_id=wid, state="verified", stored_at=t - timedelta(seconds=1),
                                        verified_at=t, checked_at=t, attempts=0))
        out["confirm_with_rogue"] = confirm_with_workers(s, ckpt_id)
        with session_scope(s.db_url) as ses:  # the positive control: the same copies on two real workers
            for c in ses.scalars(select(ContentCopy).where(ContentCopy.worker_id == "w-rogue0000000")):
                c.worker_id = w2.node_id
        out["confirm_with_real_workers"] = confirm_with_workers(s, ckpt_id)
        out["local_copy_kept"] = path.exists()

        # 3. A DELETE captured on its way to w1, replayed to w2 and to w1 again.
        sha = shards[0][0]
        p = f"/v1/shards/{sha}"
        captured = auth.sign(key, "DELETE", p, node=w1.node_id)
        replies = {}
        for name, w in (("w1", w1), ("replayed to w2", w2), ("replayed to w1", w1)):
            conn = http.client.HTTPConnection("127.0.0.1", w.port, timeout=10)
            conn.request("DELETE", p, headers=captured)
            resp = conn.getresponse()
            replies[name] = [resp.status, json.loads(resp.read() or b"{}").get("error", "")]
            conn.close()
        out["delete_replies"] = replies
        out["w2_still_holds"] = real2.head(sha) is not None

        # 4. A worker comes back under a new node id at the URL of a rejected row that has copies.
        with session_scope(s.db_url) as ses:
            ses.add(Row(id="w-oldnode00000", url=w2.url, source="static", state="rejected"))
            ses.flush()
            ses.add(ContentCopy(sha256=shards[-1][0], worker_id="w-oldnode00000", state="verified",
                                stored_at=t, verified_at=t, checked_at=t, attempts=0))

        # 5. A scheduler tick among all of them still does its other work: a store step whose
        # lease expired is sent again.
        with session_scope(s.db_url) as ses:
            stale = create_job(ses, "store", checkpoint_id=None, lease_seconds=-60).id
        sent: list[Any] = []
        quick = dataclasses.replace(s, tick_seconds=0.01)
        Scheduler(quick, lambda sends: sent.extend(sends)).tick()
        out["tick_sent"] = [[x.actor, list(x.args)] for x in sent]
        out["stale_job"] = stale
        out["rows_after_tick"] = rows()
        with session_scope(s.db_url) as ses:
            out["store_state"] = ses.get(Job, job_id).state
            out["checkpoint_local"] = ses.get(Checkpoint, ckpt_id).local_present
        out["nodes"] = {"w1": w1.node_id, "w2": w2.node_id}
        out["urls"] = {"w1": w1.url, "w2": w2.url, "relay": relay_url, "rogue": rogue_url,
                       "garbage": garbage_url, "not_json": not_json_url}
        return out
    finally:
        w1.stop()
        w2.stop()


if __name__ == "__main__":
    os.environ.setdefault("CKPT_MDNS", "0")
    print("RESULT " + json.dumps(main(Path(sys.argv[1])), default=str), flush=True)
