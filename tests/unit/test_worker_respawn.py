"""A storage worker whose server process is killed and respawned (gunicorn forks a new one
from the process that opened the store) counts its shards as they are on the disk, not as
they were when the server started."""
from __future__ import annotations

import hashlib
import os
import signal

from tests.processes import descendants, storage_workers, wait_for, worker_client


def _upload(client, tmp_path, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    src = tmp_path / f"{sha[:8]}.bin"
    src.write_bytes(data)
    client.put_range(sha, b"", str(src), 0, len(data))
    return sha


def test_a_respawned_server_process_counts_the_shards_on_disk(tmp_path):
    with storage_workers(tmp_path, 1) as (w,):
        client = worker_client(w)
        first = _upload(client, tmp_path, os.urandom(300_000))  # after the server started
        (tmp_path / "d0" / "tmp" / "left-by-a-crash").write_bytes(b"x" * 1000)
        served_by = descendants(w.proc.pid)
        assert served_by, "the storage worker serves from a forked process"
        for pid in served_by:
            os.kill(pid, signal.SIGKILL)  # a crash of the process that serves; its parent forks another
        wait_for(lambda: (set(descendants(w.proc.pid)) - set(served_by)) and client.status(), 20,
                 "a new server process")
        status = client.status()
        assert (status["shards"], status["used"]) == (1, 300_000)
        assert not (tmp_path / "d0" / "tmp" / "left-by-a-crash").exists()
        # Deleting the shard uploaded before the crash leaves the counts at zero, not below.
        assert client.delete(first)
        second = _upload(client, tmp_path, os.urandom(1000))
        status = client.status()
        assert (status["shards"], status["used"]) == (1, 1000) and client.head(second) == 1000
