"""The chaos soak: the cluster in a box under a seeded fault schedule, and its verdict.

Phases: the object store (SeaweedFS, bench/chaos/bucket.py) and the box come up and the
trainers start saving; faults are injected from the schedule
(over the first ``fault_share`` of the run) while restores are asked now and then; at the end of
the run the trainers stop after their current save and every fault still on is healed; then the
heal period, until no job is working and no copy waits for the object store, or ``drain``
seconds passed; then one restore per training
host, and the checks (bench/chaos/checks.py). The run fails if any check fails.
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.chaos import checks
from bench.chaos.box import PY, STORE, TRAINERS, ChaosBox, wait
from bench.chaos.bucket import SoakBucket
from bench.chaos.faults import KINDS, Fault, Injector, draw
from pipeline import states
from pipeline.db.engine import dispose_all


@dataclass
class Config:
    minutes: float = 30.0
    seed: int = 0
    mb: tuple[float, float] = (50.0, 300.0)  # each trainer's model size, drawn from this range
    every: tuple[float, float] = (10.0, 30.0)  # seconds between saves
    scale: float = 1.0  # fault durations (stall 30-300 s, trainer down 300 s, ...) times this
    gap: tuple[float, float] = (20.0, 60.0)  # seconds between fault starts
    fault_share: float = 0.75  # faults start in this share of the run; the rest heals under load
    drain: float = 600.0  # the heal period's limit after the run
    restore_every: float = 120.0
    restore_timeout: float = 900.0
    lease: float = 30.0
    rf: int = 2
    redis_max_mb: float = 128.0
    queue_slack: float = 4.0  # queue depth at most this many messages per outstanding job step (+ 20)
    disk_gb: float = 24.0  # each storage worker's disk (a sparse image)
    env: dict[str, str] = field(default_factory=dict)
    root: Path | None = None
    keep: bool = False

    def settings_env(self) -> dict[str, str]:
        return {"CKPT_LEASE_SECONDS": str(self.lease), "CKPT_RF": str(self.rf), "CKPT_KEEP_LAST": "2",
                "CKPT_TICK_SECONDS": "0.5", "CKPT_SCAN_INTERVAL": "2", "CKPT_SETTLE_SECONDS": "0.5",
                "CKPT_QUIET_SECONDS": "10", "CKPT_WORKER_DOWN_SECONDS": str(max(10.0, self.lease / 2)),
                "CKPT_MIN_BACKOFF_MS": "500", "CKPT_MAX_BACKOFF_MS": "10000", **self.env}


def small(minutes: float = 3.0, seed: int = 0) -> Config:
    """The suite's version: a few MB per save, a save every few seconds, faults a tenth as long."""
    return Config(minutes=minutes, seed=seed, mb=(2.0, 8.0), every=(3.0, 6.0), scale=0.1, gap=(6.0, 12.0),
                  drain=150.0, restore_every=30.0, restore_timeout=120.0, lease=8.0, redis_max_mb=64.0,
                  disk_gb=1.0, env={"CKPT_SHARD_SIZE": str(1024 * 1024), "CKPT_MAX_ATTEMPTS": "8"})


@dataclass
class Restore:
    host: str
    path: str
    checkpoint_id: int
    asked: float
    outcome: str = ""  # identical | DIFFERENT | FAILED
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Result:
    ok: bool
    failures: list[str]
    report: str
    doc: dict


class Soak:
    def __init__(self, config: Config) -> None:
        self.c = config
        self.root = config.root or Path(tempfile.mkdtemp(prefix="ckpt-chaos-"))
        rng = random.Random(config.seed)
        mb = [round(rng.uniform(*config.mb), 1) for _ in TRAINERS]
        self.bucket = SoakBucket()
        self.box = ChaosBox(self.root, disk_bytes=int(config.disk_gb * 1e9), env=config.settings_env(),
                            trainer={"mb": mb, "every": config.every, "seed": config.seed}, bucket=self.bucket)
        self.injector = Injector(self.box)
        self.faults: list[Fault] = []
        self.restores: list[Restore] = []
        self.samples: list[dict] = []
        self.queue_over: list[str] = []
        self.events: list[str] = []
        self.t0 = time.monotonic()

    # -- helpers -------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, text: str) -> None:
        line = f"[{self.now():7.1f}s] {text}"
        self.events.append(line)
        print(line, flush=True)

    def context(self) -> str:
        """The faults on now or healed within two minutes (what a finding follows)."""
        t = time.monotonic()
        near = [f for f in self.faults if f.injected_at is not None
                and (f.healed_at is None or t - f.healed_at < 120)]
        return "; ".join(f"{f.kind} {f.target} ("
                         + ("on" if f.healed_at is None else f"healed {t - f.healed_at:.0f}s ago") + ")"
                         for f in near) or "none"

    def sample_redis(self) -> None:
        s = checks.redis_sample(self.box.redis_socket)
        if s is None:
            return
        work = checks.active_work(self.box.db_url)
        depth = sum(v for k, v in s.items() if k.startswith("dramatiq:") and not k.endswith((".XQ", ".XQ.msgs"))
                    and "__" not in k)
        s.update({"t": round(self.now(), 1), "depth": depth, "work": work})
        self.samples.append(s)
        if depth > self.c.queue_slack * work + 20:
            self.queue_over.append(f"at {self.now():.0f}s {depth} messages queued for {work} outstanding job steps "
                                   f"({ {k: v for k, v in s.items() if k.startswith('dramatiq:')} }); "
                                   f"after: {self.context()}")

    # -- restores ------------------------------------------------------------------------

    def restore_one(self, save: checks.Save, checkpoint_id: int) -> Restore:
        r = Restore(save.host, save.path, checkpoint_id, self.now())
        dest = self.box.restored(save.host) / f"r{len(self.restores)}-{Path(save.path).name}"
        self.restores.append(r)
        t = time.monotonic()
        ns = self.box.box.ns[save.host]
        try:
            p = subprocess.run(["ip", "netns", "exec", ns, PY, "-m", "pipeline.cli", "restore", str(checkpoint_id),
                                "--to", str(dest), "--wait", "--timeout", str(self.c.restore_timeout)],
                               env=self.box.env(save.host), capture_output=True, text=True,
                               timeout=self.c.restore_timeout + 60)
            r.seconds = time.monotonic() - t
            if p.returncode != 0:
                said = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
                r.outcome, r.detail = "FAILED", f"exit {p.returncode}: " + " | ".join(said[-2:])[-600:]
            else:
                bad = [rel or "(file)" for rel, sha in save.files.items()
                       if not ((dest / rel if rel else dest).is_file()
                               and checks.sha256_of(dest / rel if rel else dest) == sha)]
                r.outcome = "DIFFERENT" if bad else "identical"
                r.detail = f"differs: {bad[:4]}" if bad else ""
        except subprocess.TimeoutExpired:
            r.seconds, r.outcome, r.detail = time.monotonic() - t, "FAILED", "the CLI did not return"
        finally:
            if dest.is_dir():
                shutil.rmtree(dest, ignore_errors=True)
            else:
                dest.unlink(missing_ok=True)
        self.log(f"restore of {Path(save.path).name} ({save.host}, checkpoint {checkpoint_id}): {r.outcome} "
                 f"in {r.seconds:.1f}s {r.detail[:200]}")
        return r

    def protected_saves(self, rng: random.Random, hosts: tuple[str, ...]) -> list[tuple[checks.Save, int]]:
        out = []
        saves = [s for s in checks.read_ledgers(self.box) if s.host in hosts]
        rng.shuffle(saves)
        for s in saves[:20]:
            m = checks.manifest(self.box.db_url, s)
            if m.checkpoint_id is not None and m.store_state in states.PROTECTED:
                out.append((s, m.checkpoint_id))
        return out

    def restorer(self, stop: threading.Event) -> None:
        rng = random.Random(self.c.seed + 7)
        while not stop.wait(self.c.restore_every):
            # A host is down until it recovered: healed, its processes start again and only then
            # say they consume its queue (a restore asked before is refused, rightly: no consumer).
            down = {f.host for f in self.faults if f.unconsumes_host() and f.injected_at and not f.recovered_at}
            hosts = tuple(h for h in TRAINERS if h not in down)
            try:
                picks = self.protected_saves(rng, hosts)
            except Exception as e:  # the control plane being restarted
                self.log(f"restore: could not pick a checkpoint ({type(e).__name__}: {e})")
                continue
            if picks:
                self.restore_one(*picks[0])

    # -- the run -------------------------------------------------------------------------

    def run(self) -> Result:
        c = self.c
        length = c.minutes * 60
        self.faults = draw(c.seed, first=min(30.0, length * 0.1), until=length * c.fault_share, gap=c.gap,
                           scale=c.scale)
        self.log(f"chaos soak: {c.minutes} min, seed {c.seed}, root {self.root}; trainers "
                 f"{self.box.trainer['mb']} MB every {c.every[0]:.0f}-{c.every[1]:.0f} s; lease {c.lease:.0f} s")
        for f in self.faults:
            self.log(f"  scheduled: {f}")
        try:
            self.bucket.start()
            self.box.up()
            wait(lambda: not checks.workers_not_up(self.box.db_url, self.box.urls), 120, "4 storage workers up",
                 self.box.logs)
            self.t0 = time.monotonic()
            self.box.start_trainers()
            self.log("box up; trainers started")
            with checks.Guard(self.box, c.rf, self.context) as guard:
                stop = threading.Event()
                restorer = threading.Thread(target=self.restorer, args=(stop,), daemon=True)
                restorer.start()
                try:
                    self.load(length)
                finally:
                    stop.set()
                self.log("run over: stopping the trainers after their current save, healing every fault")
                self.box.stop_trainers()
                for f in self.faults:
                    if f.injected_at is not None and f.healed_at is None:
                        self.heal(f, force=True)
                self.drain()
                restorer.join(timeout=c.restore_timeout + 120)
                for save, cid in self.last_restores():
                    self.restore_one(save, cid)
            return self.verdict(guard)
        finally:
            self.box.down()
            self.bucket.stop()
            dispose_all()
            if not c.keep:
                shutil.rmtree(self.root, ignore_errors=True)

    def heal(self, f: Fault, force: bool = False) -> None:
        while not self.injector.heal(f):
            if not force:
                return
            self.tick()
            time.sleep(0.5)
        f.healed_at, f.healed_utc = time.monotonic(), datetime.now(UTC)
        try:
            self.injector.healed(f)
        except Exception as e:  # the database between two control planes
            f.notes.append(f"in-flight stores unknown: {type(e).__name__}")
        self.log(f"healed {f.kind} {f.target}" + (f" ({len(f.pending)} stores in flight)" if f.pending else ""))

    def tick(self) -> None:
        for name in self.box.supervise():
            self.log(f"restarted {name}")
        faulted = {f.host for f in self.faults if f.injected_at is not None and f.healed_at is None}
        for f in self.faults:
            if f.healed_at is not None and f.recovered_at is None:
                try:
                    if self.injector.recovered(f, faulted):
                        f.recovered_at = time.monotonic()
                        self.log(f"recovered from {f.kind} {f.target} in {f.heal_seconds:.1f}s")
                except Exception as e:  # the database between two control planes
                    note = f"recovery check: {type(e).__name__}"
                    if note not in f.notes:  # checked again every tick: said once
                        f.notes.append(note)

    def load(self, length: float) -> None:
        next_sample = 0.0
        while self.now() < length:
            t = self.now()
            for f in self.faults:
                if f.injected_at is None and f.start <= t:
                    if not self.injector.ready(f):
                        continue  # tried again next tick
                    if t - f.start > 1:
                        f.notes.append(f"deferred {t - f.start:.0f}s")
                    self.injector.inject(f)
                    f.injected_at = time.monotonic()
                    self.log(f"inject {f.kind} {f.target} for {f.duration:.0f}s {' '.join(f.notes)}")
                    if f.duration == 0:
                        self.heal(f)
                elif f.injected_at is not None and f.healed_at is None and f.start + f.duration <= t:
                    self.heal(f)
            self.tick()
            if t >= next_sample:
                self.sample_redis()
                next_sample = t + 5
            time.sleep(0.5)

    def drain(self) -> None:
        """The heal period: until every fault recovered and no job works, or ``drain`` seconds."""
        start = time.monotonic()
        self.log("heal period")
        next_sample = 0.0
        while time.monotonic() - start < self.c.drain:
            self.tick()
            if self.now() >= next_sample:
                self.sample_redis()
                next_sample = self.now() + 5
            try:
                quiet = (checks.active_jobs(self.box.db_url) == 0
                         and all(f.recovered_at for f in self.faults if f.injected_at)
                         and not checks.workers_not_up(self.box.db_url, self.box.urls | self.store_url)
                         and not checks.store_copy_states(self.box.db_url).get(states.CopyState.PENDING.value))
            except Exception:
                quiet = False
            if quiet:
                self.log(f"quiet after {time.monotonic() - start:.0f}s")
                return
            time.sleep(1)
        self.log(f"heal period over after {self.c.drain:.0f}s, not quiet")

    @property
    def store_url(self) -> dict[str, str]:
        return {STORE: self.bucket.url}

    def last_restores(self) -> list[tuple[checks.Save, int]]:
        """One protected save per training host, preferring one no longer on its disk."""
        out = []
        for h in TRAINERS:
            picks = self.protected_saves(random.Random(self.c.seed), (h,))
            picks.sort(key=lambda p: Path(p[0].path).exists())
            out.extend(picks[:1])
        return out

    # -- the verdict -----------------------------------------------------------------------

    def verdict(self, guard: checks.Guard) -> Result:
        c = self.c
        failures: list[str] = []
        saves = checks.read_ledgers(self.box)
        verdicts = checks.protection(self.box, saves, c.rf)
        for v in verdicts:
            if v.outcome not in ("protected", "local"):
                failures.append(f"save {v.save.path} ({v.save.host}): {v.outcome}: {v.detail}")
        failures += [f"store given up: {f}" for f in checks.failed_stores(self.box.db_url)]
        for d in guard.deletions:
            if not d.ok:
                failures.append(f"unsafe deletion of {d.path} ({d.host}) at {d.at:.0f}: {d.detail}; after: {d.faults}")
        failures += [f"deletion check error: {e}" for e in guard.errors]
        for s in checks.stuck_jobs(self.box.db_url, c.lease):
            failures.append(f"stuck after the heal: {s}")
        for f in self.faults:
            if f.injected_at is not None and f.recovered_at is None:
                failures.append(f"never recovered from {f.kind} {f.target} (healed at "
                                f"{(f.healed_at or 0) - self.t0:.0f}s) {' '.join(f.notes)}")
        urls = self.box.urls | self.store_url
        for host, state in checks.workers_not_up(self.box.db_url, urls).items():
            failures.append(f"healthy worker {host} ({urls[host]}) is {state} at the end")
        off, proven = checks.off_bucket(self.bucket, verdicts)
        failures += off
        copies = checks.store_copy_states(self.box.db_url)
        given_up = {k: n for k, n in copies.items() if k not in STORE_COPY_OK}
        if given_up:
            failures.append(f"object-store copies given up or found bad (the store was only ever down): {given_up}")
        if pending := copies.get(states.CopyState.PENDING.value):
            failures.append(f"{pending} object-store copies still pending after the heal")
        peak_mem = max((s["used_memory"] for s in self.samples), default=0)
        if peak_mem > c.redis_max_mb * 1e6:
            failures.append(f"Redis used {peak_mem / 1e6:.0f} MB (bound {c.redis_max_mb:.0f} MB)")
        failures += [f"queue depth unbounded: {q}" for q in self.queue_over[:5]]
        for r in self.restores:
            if r.outcome != "identical":
                failures.append(f"restore of checkpoint {r.checkpoint_id} ({r.path}, {r.host}) asked at "
                                f"{r.asked:.0f}s: {r.outcome or 'not finished'} {r.detail[:300]}")
        if not self.restores:
            failures.append("no restore was made")
        if not saves:
            failures.append("the trainers completed no save")
        lost = sum(v.lost_bytes for v in verdicts)
        doc = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(c).items()},
            "faults": [{**{k: getattr(f, k) for k in ("kind", "target", "start", "duration", "notes")},
                        "heal_seconds": f.heal_seconds} for f in self.faults],
            "saves": len(saves), "saved_bytes": sum(s.bytes for s in saves),
            "outcomes": {o: sum(1 for v in verdicts if v.outcome == o) for o in {v.outcome for v in verdicts}},
            "deletions": len(guard.deletions), "unsafe_deletions": sum(1 for d in guard.deletions if not d.ok),
            "restores": [dataclasses.asdict(r) for r in self.restores], "bytes_lost": lost,
            "redis_peak_mb": round(peak_mem / 1e6, 1),
            "queue_peak": max((s["depth"] for s in self.samples), default=0),
            "dead_letters": max((sum(v for k, v in s.items() if k.endswith(".XQ")) for s in self.samples), default=0),
            "jobs": checks.store_states(self.box.db_url), "failures": failures,
            "bucket": {"proven_shards": proven, "protected_required": sum(
                1 for v in verdicts if v.store_state in states.PROTECTED and v.save.required),
                "protected_lag": sum(1 for v in verdicts if v.store_state in states.PROTECTED and not v.save.required),
                "copies": copies},
            "restarts": {f"{p.host}/{p.role}": p.restarts for p in self.box.procs.values() if p.restarts},
        }
        return Result(not failures, failures, table(doc), doc)


#: Copy states an object-store copy may end in when the store was only ever throttled or cut off
#: (trimmed, deleting: retention's own decisions).
STORE_COPY_OK = frozenset({states.CopyState.PENDING.value, states.CopyState.STORED.value,
                           states.CopyState.VERIFIED.value, states.CopyState.TRIMMED.value,
                           states.CopyState.DELETING.value})


def table(doc: dict) -> str:
    lines = [f"{'fault':<16} {'times':>5} {'heal p50 s':>10} {'heal max s':>10}  not healed",
             "-" * 60]
    for kind in KINDS:
        fs = [f for f in doc["faults"] if f["kind"] == kind]
        healed = [f["heal_seconds"] for f in fs if f["heal_seconds"] is not None]
        p50 = f"{statistics.median(healed):.1f}" if healed else "-"
        mx = f"{max(healed):.1f}" if healed else "-"
        lines.append(f"{kind:<16} {len(fs):>5} {p50:>10} {mx:>10}  {len(fs) - len(healed)}")
    lines.append("-" * 60)
    restores = doc["restores"]
    lines += [
        f"saves completed {doc['saves']} ({doc['saved_bytes'] / 1e6:.0f} MB): "
        + ", ".join(f"{k} {v}" for k, v in sorted(doc["outcomes"].items())),
        f"local deletions {doc['deletions']}, unsafe {doc['unsafe_deletions']}",
        f"restores {len(restores)}, byte-identical {sum(1 for r in restores if r['outcome'] == 'identical')}",
        f"Redis peak {doc['redis_peak_mb']} MB, queue depth peak {doc['queue_peak']}, "
        f"dead letters {doc['dead_letters']}",
        f"bytes lost {doc['bytes_lost']}",
        f"object store: {doc['bucket']['proven_shards']} shards of {doc['bucket']['protected_required']} protected "
        f"required-run and {doc['bucket']['protected_lag']} lag-run saves proven on the bucket; copies "
        + ", ".join(f"{k} {v}" for k, v in sorted(doc["bucket"]["copies"].items())),
        "jobs: " + ", ".join(f"{k} {v}" for k, v in sorted(doc["jobs"].items())),
    ]
    if doc["restarts"]:
        lines.append("restarted by the box: " + ", ".join(f"{k} {v}" for k, v in sorted(doc["restarts"].items())))
    lines.append("PASS" if not doc["failures"] else f"FAIL ({len(doc['failures'])}):")
    lines += [f"  - {f}" for f in doc["failures"][:40]]
    return "\n".join(lines)


def save_doc(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
