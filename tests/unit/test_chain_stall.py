"""Deadlines by progress, blame by evidence, between real storage worker processes on loopback:
a hop of a chain that stalls (SIGSTOP: its kernel still accepts the connection and buffers
what fits, the process answers nothing) is named by the worker before it, after the stall
timeout, while the workers before that one are still waiting; nothing waits a fixed 600 s."""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from pipeline.cluster.client import WorkerClient
from tests.processes import KEY, StorageWorker, storage_workers

STALL = 2.0


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    with storage_workers(tmp_path_factory.mktemp("chain-stall"), 3) as ws:
        yield ws


@contextlib.contextmanager
def stopped(w: StorageWorker) -> Iterator[None]:
    """``w`` and its gunicorn children SIGSTOPped, and continued whatever happens."""
    pids = w.pids()
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def send(tmp_path, first: StorageWorker, chain: list[StorageWorker], size: int) -> tuple[dict, float]:
    data = os.urandom(size)
    src = tmp_path / "src"
    src.write_bytes(data)
    started = time.monotonic()
    answer = WorkerClient(first.url, KEY.encode(), first.node_id, timeout=STALL).put_range(
        hashlib.sha256(data).hexdigest(), b"", str(src), 0, size, chain=[(w.node_id, w.url) for w in chain])
    return answer, time.monotonic() - started


# 200 kB fits in the stopped worker's socket buffers (the hop before it waits for its answer);
# 64 MiB does not (it waits to send).
@pytest.mark.parametrize("size", [200_000, 64 << 20], ids=["answer stalls", "bytes stall"])
def test_a_stalled_last_hop_is_named_by_the_hop_before_it_and_the_first_is_not_blamed(three, tmp_path, size):
    first, second, third = three
    with stopped(third):
        answer, took = send(tmp_path, first, [second, third], size)
    assert answer["created"] is True  # the first hop stored its copy and answered: not blamed
    ok, failed = answer["chain"]
    assert ok == {"node": second.node_id, "ok": True, "created": True}
    assert failed["node"] == third.node_id and failed["ok"] is False and failed["status"] is None
    assert f"no byte moved for {STALL:g} s" in failed["error"], failed
    assert took < 60  # the stall timeout per hop, not 600 s


def test_a_stalled_middle_hop_is_named_and_the_one_after_it_was_never_sent(three, tmp_path):
    first, second, third = three
    with stopped(second):
        answer, _took = send(tmp_path, first, [second, third], 200_000)
    middle, last = answer["chain"]
    assert middle["node"] == second.node_id and middle["status"] is None and "no byte moved" in middle["error"]
    assert last["node"] == third.node_id and last["ok"] is False and "status" not in last
