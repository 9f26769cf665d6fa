"""Storage workers crashed, hung or full; the local disk full; the source changed under the pipeline."""
from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

from tests.faults.harness import FaultCluster, Table, check_rows, store_until, trial
from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_storage_worker_killed_mid_upload_and_after_rename(fault_cluster: FaultCluster, trials: int):
    c = fault_cluster
    rows = []
    for name, what in (("worker.put.write", "mid-upload"), ("worker.put.renamed", "after rename, before answering")):
        row = rows.append(Table.row(f"SIGKILL storage worker {what}")) or rows[-1]
        for _ in range(trials):
            c.arm(name, "kill", where="worker0")
            trial(c, row, lambda: store_until(c, lambda: c.fired(name, "worker0"), f"{name} fired on worker0"),
                  name, where="worker0")
    check_rows(*rows)


def test_storage_worker_stopped_then_continued(fault_cluster: FaultCluster, trials: int):
    """SIGSTOP mid-upload (slow, not dead), SIGCONT 5 s later: the store completes."""
    c = fault_cluster
    row = Table.row("SIGSTOP storage worker mid-upload, SIGCONT after 5 s")
    for _ in range(trials):
        c.arm("worker.put.write", "stop", where="worker1")

        def fire() -> None:
            # Placement (rendezvous on the workers' random ids) may give worker1 no copy of
            # one checkpoint: stores go on until one writes to it. Continued whatever happens,
            # or the module's cluster would keep a stopped worker for the tests after this one.
            try:
                store_until(c, lambda: c.fired("worker.put.write", "worker1"), "stopped worker1 at a write")
                time.sleep(5)
            finally:
                for pid in c.workers[1].pids():
                    os.kill(pid, signal.SIGCONT)

        trial(c, row, fire, "worker.put.write", where="worker1")
    check_rows(row)


def test_storage_worker_disk_full(fault_cluster: FaultCluster, trials: int):
    """ENOSPC on one worker at write, then at fsync: its replicas go to the other workers."""
    c = fault_cluster
    rows = []
    for name in ("worker.put.write", "worker.put.fsync"):
        row = rows.append(Table.row(f"ENOSPC on one storage worker at {name.rsplit('.', 1)[1]}")) or rows[-1]
        for _ in range(trials):
            c.arm(name, "always enospc", where="worker2")
            try:
                trial(c, row, lambda: store_until(c, lambda: c.hits(name, "worker2"), "hit the full disk"), None)
            finally:
                c.disarm(name, where="worker2")
    check_rows(*rows)


def test_local_disk_full_during_restore(fault_cluster: FaultCluster, tmp_path):
    """ENOSPC on every write of a restore: it fails with the reason, leaves nothing behind,
    and succeeds once there is space again."""
    c = fault_cluster
    src = c.new_checkpoint()
    c.quiet()
    row = Table.row("ENOSPC on the local disk while restoring")
    dest = tmp_path / "restored.safetensors"
    c.arm("restore.write", "always enospc")
    try:
        start = time.time()
        r = c.cli("restore", str(src), "--to", str(dest), "--wait", timeout=120)
        assert r.returncode == 1 and "No space left on device" in r.stderr, r.stderr
        assert c.hits("restore.write") >= 2  # retried before giving up
    finally:
        c.disarm("restore.write")
    assert not dest.exists() and not list(tmp_path.iterdir()), list(tmp_path.iterdir())
    r = c.cli("restore", str(src), "--to", str(dest), "--wait", timeout=120)
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == src.read_bytes()
    row.add(c.check(), time.time() - start, "restore failed, then done")
    check_rows(row)


def rewrite_in_place(path) -> None:
    """The trainer writes new bytes into the same file (same size, new mtime). New bytes each
    time: a second rewrite that wrote the same bytes again would only touch the file, which
    rotation may then rightly delete (its content is stored)."""
    data = bytearray(path.read_bytes())
    data[-1000:] = os.urandom(1000)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(time.time_ns(), time.time_ns()))


def test_source_rewritten_before_replication_and_before_rotation(fault_cluster: FaultCluster, trials: int):
    c = fault_cluster
    early = Table.row("source rewritten between detection and replication")
    late = Table.row("source rewritten after verify, before rotation")
    for _ in range(trials):
        c.arm("shard.commit1.after", "sleep 2")

        def rewrite_while_sharding() -> None:
            path = c.new_checkpoint()
            wait_for(lambda: c.fired("shard.commit1.after"), 30, "the shard step to start")
            rewrite_in_place(path)

        trial(c, early, rewrite_while_sharding, "shard.commit1.after")
        assert "store superseded" in "; ".join(early.outcomes), early.outcomes

        # The newest checkpoint is rewritten in place while the watcher is paused, and the
        # next one is stored with `ckpt store`: only rotation can notice the rewrite.
        older = c.run / f"step_{c.step}.safetensors"
        refusals = len(c.notes_containing("changed after it was stored"))
        rewritten: list[bytes] = []

        def rewrite_then_store_next() -> None:
            watcher = c.up_info()["children"]["watcher"]
            os.kill(watcher, signal.SIGSTOP)
            try:
                rewrite_in_place(older)
                rewritten.append(older.read_bytes())
                r = c.cli("store", str(c.new_checkpoint()), "--wait", timeout=60)
                assert r.returncode == 0, r.stderr
                wait_for(lambda: len(c.notes_containing("changed after it was stored")) > refusals, 30,
                         "rotation to refuse the rewritten checkpoint")
            finally:
                os.kill(watcher, signal.SIGCONT)

        trial(c, late, rewrite_then_store_next, None)
        # The watcher, continued, records the rewritten bytes as the path's new version: recorded
        # after the next step, it is the newest save by detection order, which rotation never
        # takes (pipeline.core.retention.newest_ids); the bytes stay on disk.
        wait_for(lambda: c.recorded(older, hashlib.sha256(rewritten[0]).hexdigest()), 30,
                 "the watcher to record the rewritten bytes")
        c.quiet()
        assert older.read_bytes() == rewritten[0]
    check_rows(early, late)


def test_a_save_that_lands_on_a_checkpoint_as_rotation_deletes_it_is_never_deleted(fault_cluster: FaultCluster,
                                                                                  trials: int):
    """Rotation checks a checkpoint's files, then renames it into the trash, then deletes it once
    its decision committed. A new save renamed over the path between the check and the rename,
    or bytes written through a file held open after the decision, are not what was stored: they
    go back to the path, never deleted, and the watcher stores them."""
    c = fault_cluster
    over = Table.row("new save renamed over a checkpoint as rotation trashes it")
    held = Table.row("checkpoint written through an open file as rotation deletes it")
    if c.step == 0:
        c.new_checkpoint()
    for _ in range(trials):
        for row, where in ((over, "rotate.trash"), (held, "rotate.remove")):
            c.quiet()
            older = c.run / f"step_{c.step}.safetensors"  # the newest: kept until the next step
            point = f"{where}.{older.name}"  # this checkpoint's rotation, not another one's
            new_bytes: list[bytes] = []
            c.arm(point, "sleep 3")
            f = open(older, "r+b")
            try:
                def save_next_then_resave_older() -> None:
                    c.new_checkpoint()  # stored, it makes the older one rotation's to delete
                    wait_for(lambda: c.fired(point), 60, f"rotation to reach {point}")
                    data = bytearray(older.read_bytes() if where == "rotate.trash" else b"")
                    if where == "rotate.trash":  # a trainer's save: a new file renamed over the path
                        data[-1000:] = os.urandom(1000)
                        tmp = older.with_name(f".{older.name}.tmp")
                        tmp.write_bytes(data)
                        os.rename(tmp, older)
                        new_bytes.append(bytes(data))
                    else:  # a writer that held the file open writes to it (now in the trash)
                        f.seek(-1000, os.SEEK_END)
                        f.write(os.urandom(1000))
                        f.flush()
                        f.seek(0)
                        new_bytes.append(f.read())

                trial(c, row, save_next_then_resave_older, point)
            finally:
                f.close()
                c.disarm(point)
            # Not deleted: back at its path, and recorded by the watcher as the path's new save.
            wait_for(lambda: c.recorded(older, hashlib.sha256(new_bytes[0]).hexdigest()), 30,
                     "the watcher to record the bytes saved over the rotated checkpoint")
            c.quiet()
            assert older.read_bytes() == new_bytes[0]
    assert c.notes_containing("changed while it was being rotated")
    check_rows(over, held)
