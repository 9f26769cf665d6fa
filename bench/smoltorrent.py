"""``--parts smoltorrent``: ours beside smoltorrent, on loopback, in one run.

smoltorrent (github.com/YuvrajSingh-mist/smoltorrent, MIT) shards a safetensors checkpoint over
TCP workers with RF 2 and gathers it back into one file. Its code is not part of this
repository: ``--smoltorrent-dir PATH`` names a checkout of it (``git clone`` it anywhere), of
which this part runs a scratch copy under the work directory.

One ~0.99 GB bf16 checkpoint per run (bench/layouts.py), stored and restored by each system,
the two alternating (run 1 ours first, run 2 smoltorrent first), 2 runs each:

- **ours**: ``ckpt up`` with 3 storage workers, RF 2 (bench/system.py); ``ckpt store --wait`` and
  ``ckpt restore --wait`` timed as the command's wall time, its start-up included (what a
  person waits for).
- **smoltorrent**: 3 of its workers, each a process serving its own connection handler
  (``algorithms/SyncPS/worker.py`` ``_handle_shard_client``) from a loop bound to a 127.0.0.1
  port: its ``run_worker`` also advertises on mDNS and starts a metrics server, neither of
  which may run here. Its config (the scratch copy's ``configs/config.yaml``) names the three
  by 127.0.0.1 and port: a static list, loopback only. Its store and gather are its API's own
  endpoint functions (``backend/api.py`` ``store_shard``, ``gather_shards``: RF 2, its
  ``REDUNDANCY``) run in one process that stays up, as its API server does, each timed from
  the call to its "Done:" line: a warm server's time, no HTTP hop and no start-up (ours is
  timed with both). The gather's generator is closed at that line: what follows fetches
  tokenizer files from the HF hub. fastapi, uvicorn and httpx are stubs there (the HTTP layer
  only carries the lines; the stub httpx refuses any call).

Both read their disks cold: the source file's pages are dropped before each store, every
stored copy's before each restore. The restore limit (bench/limits.py: one copy of every
shard read cold, hashed and written with fsync) is measured before the first restore and
after the last, over our copies. Each restored file's SHA-256 is compared with the source's.
smoltorrent writes its gathered file's header again from the parsed JSON (without the
writer's padding), so its bytes can differ from the source while its tensor bytes match: the
table says both.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

from bench import layouts, limits
from bench.system import System, replica_files, restore, store

#: The checkpoint of each run, in bytes (the issue's harness: 0.99 GB).
SIZE = int(0.99e9)
RUNS = 2
#: What a checkout must hold for this part to drive it.
NEEDED = ("backend/api.py", "algorithms/SyncPS/worker.py", "networking/send_receive.py", "utils/shard_tracker.py")
#: Not copied into the scratch copy: its history, data and docs.
SKIPPED = (".git", ".venv", "shards", "shard_map.db", "shard_map.json", "logging", "test", "docs", "diagrams",
           "monitoring")
RESULT = "@@result "
READY = "@@ready"


def missing(checkout: str | None) -> str | None:
    """Why this part cannot run with ``checkout`` (None: it can)."""
    if not checkout:
        return ("needs a checkout of smoltorrent: `git clone https://github.com/YuvrajSingh-mist/smoltorrent "
                "/tmp/smoltorrent`, then pass `--smoltorrent-dir /tmp/smoltorrent` (its code is not part of "
                "this repository; the part runs a scratch copy of it on loopback)")
    lacking = [p for p in NEEDED if not (Path(checkout) / p).is_file()]
    if lacking:
        return f"needs a smoltorrent checkout at --smoltorrent-dir {checkout}: it has no {', '.join(lacking)}"
    return None


# -- inside smoltorrent's processes --------------------------------------------------------


def _stub_web_layer() -> None:
    """fastapi, uvicorn and httpx as stubs: its endpoints become plain generator functions, and
    nothing of it can reach a network (the gather ends by downloading from the HF hub)."""
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the benchmark's smoltorrent makes no HTTP calls")

    class App:
        def __init__(self, **_kwargs: object) -> None:
            pass

        def mount(self, *_args: object) -> None:
            pass

        def post(self, _path: str) -> Any:
            return lambda fn: fn

        get = post

    fastapi = types.ModuleType("fastapi")
    fastapi.FastAPI = App  # type: ignore[attr-defined]
    fastapi.Query = lambda default=None, **_kwargs: default  # type: ignore[attr-defined]
    responses = types.ModuleType("fastapi.responses")
    responses.StreamingResponse = lambda content, media_type=None: content  # type: ignore[attr-defined]
    fastapi.responses = responses  # type: ignore[attr-defined]
    httpx = types.ModuleType("httpx")
    httpx.__getattr__ = lambda _name: refuse  # type: ignore[method-assign]
    uvicorn = types.ModuleType("uvicorn")
    uvicorn.run = refuse  # type: ignore[attr-defined]
    sys.modules.update({"fastapi": fastapi, "fastapi.responses": responses, "httpx": httpx, "uvicorn": uvicorn})


def _answers() -> Any:
    """This process's channel to the bench (its stdout as it started); anything smoltorrent's
    code prints goes to stderr, the log, instead, so it can never fill a pipe nobody reads."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _load(checkout: Path, relpath: str, name: str) -> types.ModuleType:
    """Import one of smoltorrent's scripts (they are not in packages) from the checkout (the cwd)."""
    _stub_web_layer()
    sys.path.insert(0, str(checkout))
    spec = importlib.util.spec_from_file_location(name, checkout / relpath)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve_worker(rank: int, port: int) -> None:
    """One smoltorrent worker on 127.0.0.1:``port``: its own handler, per connection a thread
    (as its ``_shard_listener``, which binds every interface)."""
    answers = _answers()
    worker = _load(Path.cwd(), "algorithms/SyncPS/worker.py", "smoltorrent_worker")
    log = logging.getLogger(f"[WORKER-{rank}]")
    server = socket.create_server(("127.0.0.1", port))
    print(READY, file=answers)
    while True:
        conn, addr = server.accept()
        threading.Thread(target=worker._handle_shard_client, args=(conn, addr, log), daemon=True).start()


def serve_coordinator() -> None:
    """smoltorrent's API endpoints, called for each request read from stdin (a JSON line:
    ``{"op": "store", "path": P}`` or ``{"op": "gather", "key": K}``); each answer is one line."""
    answers = _answers()
    api = _load(Path.cwd(), "backend/api.py", "smoltorrent_api")
    print(READY, file=answers)
    for line in sys.stdin:
        ask = json.loads(line)
        said: list[str] = []
        t = time.perf_counter()
        if ask["op"] == "store":
            lines = api.store_shard(ckpt_path=ask["path"])
        else:
            lines = api.gather_shards(shard_key=ask["key"])
        with contextlib.closing(lines):
            for said_line in lines:
                said.append(said_line.strip())
                if said_line.startswith(("Done:", "ERROR:")) and ask["op"] == "gather":
                    break  # what follows downloads tokenizer files from the HF hub
        seconds = time.perf_counter() - t
        ok = any(s.startswith("Done:") for s in said) and not any(s.startswith("ERROR:") for s in said)
        print(RESULT + json.dumps({"seconds": seconds, "ok": ok, "said": said[-3:]}), file=answers)


# -- driving them --------------------------------------------------------------------------


class Smoltorrent:
    """A scratch copy of a smoltorrent checkout running 3 workers and its coordinator on loopback."""

    def __init__(self, checkout: Path, work: Path) -> None:
        self.root = work / "smoltorrent"
        self.ckpt_root = work / "smol-checkpoints"
        self.work = work
        shutil.copytree(checkout, self.root, ignore=shutil.ignore_patterns(*SKIPPED))
        self.ckpt_root.mkdir(parents=True)
        self.procs: list[subprocess.Popen] = []
        self.coordinator: subprocess.Popen | None = None

    def _config(self, ports: list[int]) -> None:
        """Its config: the master and three workers, every one at 127.0.0.1."""
        import yaml

        (self.root / "configs").mkdir(exist_ok=True)
        (self.root / "configs" / "config.yaml").write_text(yaml.safe_dump({
            "ckpt_root": str(self.ckpt_root), "save_path": str(self.work / "smol-received" / "model.safetensors"),
            "n_chunks": 10, "num_workers": len(ports),
            "devices_config": {
                "master": [{"host": "localhost", "ip": "127.0.0.1", "rank": 0, "port": 0}],
                "workers": [{"host": f"w{rank}", "ip": "127.0.0.1", "rank": rank, "port": port}
                            for rank, port in enumerate(ports, start=1)]}}, sort_keys=False))

    def _start(self, *args: str, log: str, stdin: bool = False) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HOME": str(self.work),
               "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "bench.smoltorrent", *args], cwd=self.root, env=env,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=open(self.work / log, "wb"), text=True, start_new_session=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == READY:
                return proc
        raise RuntimeError(f"smoltorrent {args[0]} did not start; see {self.work / log}")

    def __enter__(self) -> Smoltorrent:
        from pipeline.cluster.client import free_port

        ports = [free_port() for _ in range(3)]
        self._config(ports)
        try:
            for rank, port in enumerate(ports, start=1):
                self._start("worker", str(rank), str(port), log=f"smol-worker-{rank}.log")
            self.coordinator = self._start("coordinator", log="smol-coordinator.log", stdin=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)

    def _ask(self, **request: str) -> dict:
        assert self.coordinator and self.coordinator.stdin and self.coordinator.stdout
        self.coordinator.stdin.write(json.dumps(request) + "\n")
        self.coordinator.stdin.flush()
        for line in self.coordinator.stdout:
            if line.startswith(RESULT):
                answer = json.loads(line[len(RESULT):])
                if not answer["ok"]:
                    raise RuntimeError(f"smoltorrent {request['op']} failed: {answer['said']}")
                return answer
        raise RuntimeError(f"smoltorrent's coordinator exited; see {self.work / 'smol-coordinator.log'}")

    def place(self, source: Path, key: str) -> Path:
        """``source`` where its store takes it from: ``<ckpt_root>/<key>/model.safetensors`` (a hard link)."""
        path = self.ckpt_root / key / "model.safetensors"
        path.parent.mkdir(parents=True)
        os.link(source, path)
        return path

    def store(self, path: Path) -> float:
        return self._ask(op="store", path=str(path))["seconds"]

    def gather(self, key: str) -> tuple[float, Path]:
        """Gather ``key`` (the stored file's folder under its root); (seconds, the gathered file)."""
        return self._ask(op="gather", key=key)["seconds"], self.ckpt_root / key / "merged.safetensors"

    def copies(self) -> list[Path]:
        return sorted((self.root / "shards").rglob("*.safetensors"))


def tensor_bytes_sha256(path: Path) -> str:
    """SHA-256 of a safetensors file's tensor bytes (after its header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        return hashlib.file_digest(f, "sha256").hexdigest()


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def measure_smoltorrent(work: Path, checkout: Path, *, runs: int = RUNS, size: int = SIZE) -> dict:
    res: dict = {"runs": [], "load_before": _uptime()}
    with System(work / "sys-smol", CKPT_SETTLE_SECONDS="3600", CKPT_SCRUB_RATE="0") as system, \
            Smoltorrent(checkout, work) as smol:
        (system.runs / "run").mkdir()
        restore_limits: list[float] = []
        for i in range(1, runs + 1):
            res["runs"].append(_run(system, smol, i, size, restore_limits))
        restore_limits.append(limits.restore_limit_seconds(our_copies(system, res["runs"][-1]),
                                                           work / "scratch"))
    res["limit_restore_runs_s"] = restore_limits
    res["limit_restore_s"] = statistics.mean(restore_limits)
    res["load_after"] = _uptime()
    return res


def our_copies(system: System, row: dict) -> list[Path]:
    """Our stored copies of the checkpoint of ``row``: what the restore limit reads."""
    return replica_files(system, row["checkpoint_id"])


def _run(system: System, smol: Smoltorrent, i: int, size: int, restore_limits: list[float]) -> dict:
    """Run ``i``: a new checkpoint stored by both, then restored by both (ours first in odd runs);
    the restore limit is measured before the first run's restores."""
    work = smol.work
    path = layouts.write_file(layouts.decoder(size, seed=i), system.runs / "run" / f"step_{i}.safetensors")
    limits.flush(path)
    _, source_sha = limits.sha256_seconds(path)
    key = f"run/step_{i}"
    smol_path = smol.place(path, key)
    row: dict = {"bytes": path.stat().st_size, "ours_first": i % 2 == 1}

    def ours_store() -> None:
        limits.drop_cache(path)
        stored = store(system, path)
        row["ours_store_s"], row["checkpoint_id"] = stored["seconds"], stored["checkpoint_id"]

    def smol_store() -> None:
        limits.drop_cache(path)
        row["smol_store_s"] = smol.store(smol_path)

    def ours_restore() -> None:
        dest = work / f"restored-{i}.safetensors"
        for c in our_copies(system, row):
            limits.drop_cache(c)
        row["ours_restore_s"] = restore(system, row["checkpoint_id"], dest)["seconds"]
        row["ours_served"] = system.last_served
        row["ours_identical"] = limits.sha256_seconds(dest)[1] == source_sha
        dest.unlink()
        # The same restore with the command's own start-up (CKPT_WARM=0: not through ckpt up's
        # command server, pipeline/service/commands.py), right after, for the difference.
        for c in our_copies(system, row):
            limits.drop_cache(c)
        row["ours_cold_restore_s"] = restore(system, row["checkpoint_id"], dest, CKPT_WARM="0")["seconds"]
        row["ours_cold_identical"] = limits.sha256_seconds(dest)[1] == source_sha
        dest.unlink()

    def smol_restore() -> None:
        for c in smol.copies():
            limits.drop_cache(c)
        row["smol_restore_s"], gathered = smol.gather(key)
        row["smol_identical"] = limits.sha256_seconds(gathered)[1] == source_sha
        row["smol_tensors_identical"] = tensor_bytes_sha256(gathered) == tensor_bytes_sha256(path)
        gathered.unlink()

    steps = ((ours_store, smol_store), (ours_restore, smol_restore))
    for first, second in steps if row["ours_first"] else [(b, a) for a, b in steps]:
        first()
        second()
        if first in (ours_store, smol_store) and not restore_limits:
            restore_limits.append(limits.restore_limit_seconds(our_copies(system, row), work / "scratch"))
    return row


def table(doc: dict) -> str:
    runs, limit = doc["runs"], doc["limit_restore_s"]
    lines = [f"ours beside smoltorrent on loopback: {runs[0]['bytes'] / 1e9:.2f} GB bf16, 3 workers each, RF 2; "
             f"load average {doc['load_before']} before, {doc['load_after']} after",
             f"restore limit (read cold + hash + fsynced write) {limit:.2f} s "
             f"(before / after: {' / '.join(f'{x:.2f}' for x in doc['limit_restore_runs_s'])})",
             f"{'run':<5}{'first':<13}{'store s':>16}{'restore s':>18}{'ours/smol':>11}{'restore/limit':>17}"
             f"   identical (sha256)",
             f"{'':<18}{'ours':>8}{'smol':>8}{'ours':>9}{'smol':>9}{'restore':>11}{'ours':>8}{'smol':>9}"]
    for i, r in enumerate(runs, start=1):
        lines.append(f"{i:<5}{'ours' if r['ours_first'] else 'smoltorrent':<13}{r['ours_store_s']:>8.2f}"
                     f"{r['smol_store_s']:>8.2f}{r['ours_restore_s']:>9.2f}{r['smol_restore_s']:>9.2f}"
                     f"{r['ours_restore_s'] / r['smol_restore_s']:>11.2f}{r['ours_restore_s'] / limit:>8.2f}"
                     f"{r['smol_restore_s'] / limit:>9.2f}   ours {r['ours_identical']}, smoltorrent "
                     f"{r['smol_identical']} (tensor bytes {r['smol_tensors_identical']})")
    lines.append("ours run by ckpt up's command server: " + ", ".join(str(r.get("ours_served")) for r in runs)
                 + "; the same restore with its own start-up (CKPT_WARM=0), right after: "
                 + ", ".join(f"{r['ours_cold_restore_s']:.2f} s ({r['ours_cold_restore_s'] / r['smol_restore_s']:.2f}x "
                             f"smoltorrent's, identical {r['ours_cold_identical']})" for r in runs
                             if "ours_cold_restore_s" in r))
    worst = max(r["ours_restore_s"] / r["smol_restore_s"] for r in runs)
    lines.append(f"targets: restore <= 0.8 x smoltorrent's (worst run {worst:.2f}) and <= 1.3 x the limit "
                 f"(worst run {max(r['ours_restore_s'] for r in runs) / limit:.2f})")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        serve_worker(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "coordinator":
        serve_coordinator()
