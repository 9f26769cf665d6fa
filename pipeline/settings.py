"""Configuration in one place.

A :class:`Settings` is built from defaults, then ``<home>/config.toml``, then the settings the
running ``ckpt up`` of the home records (``<home>/effective.toml``, pipeline/effective.py),
then the ``CKPT_*`` environment, then explicit overrides (command-line flags); relative paths
are made absolute as they are read. Nothing else in the code base reads ``os.environ``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import logging
import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import effective, hostid, masking, priority
from pipeline import home as home_mod
from pipeline.core.copies import Need
from pipeline.core.retention import Policy
from pipeline.durable import write_once
from pipeline.errors import ConfigError
from pipeline.masking import masked_url
from pipeline.objectstore import config as targets_config

MiB = 1024 * 1024


@dataclass(frozen=True)
class RootOptions:
    """How detection decides that a checkpoint under one root is complete, and how its
    copies leave the host."""

    quiet_seconds: float
    commit_marker: str
    replication: str = "chain"


@dataclass(frozen=True)
class Settings:
    #: Directory holding the SQLite file, the embedded Redis, keys and local worker data.
    home: Path = Path(".ckpt")
    #: SQLAlchemy URL of the control plane; empty means ``sqlite:///<home>/ckpt.db``.
    database_url: str = ""
    #: Redis URL of the Dramatiq broker; empty means the embedded one under ``<home>/redis``.
    redis_url: str = ""
    #: Watched roots: directories or globs; every match is a run directory.
    roots: tuple[str, ...] = ()
    #: Replication factor: replicas per shard on distinct storage workers (per run, ``rf`` in a
    #: ``[runs."<glob>"]`` table; a content shared by runs takes the largest: pipeline/db/content_rf.py).
    rf: int = 2
    #: Checkpoints kept locally per run (newest first); older ones rotate once safe.
    keep_last: int = 2
    #: Target shard size; safetensors files are cut at tensor boundaries near it.
    shard_size: int = 64 * MiB
    #: A checkpoint must not change for this long before it is detected. Structure proves
    #: completeness (docs/design.md, section 2); this only absorbs writers that pause mid-file. A
    #: change after detection is still caught (the shard step re-hashes; workers check).
    settle_seconds: float = 0.3
    #: A checkpoint with files that have no structure to check (a legacy pickle, an unknown
    #: format) counts as complete once nothing in it changed for this long. Files with
    #: structure (safetensors, torch.save zips, JSON, a DCP .metadata) or a known layout
    #: (pipeline.core.layouts) never wait for it. 60 s: see docs/design.md, section 2.
    quiet_seconds: float = 60.0
    #: When set, a checkpoint folder is complete only once a file of this name is in it:
    #: the writer's own commit marker (Orbax style), dropped after everything else.
    commit_marker: str = ""
    #: Per-root overrides of quiet_seconds and commit_marker, as JSON
    #: ``{"<root>": {"quiet_seconds": 120, "commit_marker": "COMMITTED"}}``; in config.toml,
    #: ``[roots."<root>"]`` tables.
    root_options: str = ""
    #: Remote retention (restic's vocabulary; 0 turns a rule off; with every rule off, the
    #: default, every protected checkpoint stays restorable for ever). A checkpoint no rule
    #: keeps is forgotten and its content collected once nothing kept references it; pins and
    #: each run's newest protected checkpoint are always kept. Per run, ``[runs."<glob>"]``
    #: tables in config.toml override these (keys without the ``remote_`` prefix).
    remote_keep_last: int = 0
    remote_keep_every: int = 0
    remote_keep_hourly: int = 0
    remote_keep_daily: int = 0
    remote_keep_weekly: int = 0
    remote_keep_monthly: int = 0
    #: Keep the best K by a metric of the checkpoint's trainer_state.json (min or max).
    remote_keep_best: int = 0
    remote_best_metric: str = ""
    remote_best_mode: str = "min"
    #: Per-run overrides of the remote policy, as JSON ``{"<run glob>": {"keep_last": 5}}``.
    run_options: str = ""
    #: Job history of a forgotten checkpoint is compacted (its events dropped, the jobs kept)
    #: after this many days.
    forgotten_history_days: float = 30.0
    #: A run whose newest checkpoint has waited this long without being protected is shown
    #: as falling behind (status, UI, metrics).
    lag_warning_seconds: float = 900.0
    #: The watcher rescans every root this often even without file events.
    scan_interval: float = 5.0
    #: Threads hashing the checkpoints the watcher found complete, each run in its own lane (one
    #: checkpoint at a time per run): a big checkpoint of one run never delays another run's.
    hash_threads: int = 2
    #: How far below training the tool runs on a host (pipeline/priority.py): ``ckpt up``'s
    #: services and the process recording a trainer's saves start at this nice value (0-19)...
    nice: int = 10
    #: ...and this I/O priority (``best-effort:0-7``, ``idle`` or ``none``; BFQ disks only).
    ionice: str = "best-effort:7"
    #: A file larger than this is reported ("not protected"), not hashed by the watcher (0: no
    #: limit). A file of 1 GiB or more of which the disk holds less than ``sparse_ratio`` of its
    #: size (a ``truncate -s 100T`` file) is reported the same way (0: never). A filesystem that
    #: compresses (ZFS, btrfs) can hold far less than a file's size: set ``sparse_ratio`` to 0 there.
    max_hash_bytes: int = 1024 * 1024 * MiB
    sparse_ratio: float = 0.01
    #: A job whose lease is older than this is re-driven by the scheduler.
    lease_seconds: float = 60.0
    #: Each Dramatiq worker process says this often which queues it consumes; a queue silent
    #: for three beats has no live consumer: its host is down (pipeline/consumers.py).
    consumer_beat_seconds: float = 5.0
    #: An idle Dramatiq consumer of `ckpt up` looks for messages at most this many ms apart
    #: (backing off from a few ms after its last message): a step whose queue was idle may wait
    #: this long; lower costs CPU on an idle host (100: 2 s a minute, 500: 0.5 s).
    poll_ms: int = 500
    #: Executions of one step before its job is marked failed (stale deliveries not included).
    max_attempts: int = 5
    #: A replica verification older than this no longer allows rotation.
    freshness_seconds: float = 48 * 3600.0
    #: A storage worker whose disk is fuller than this (used / capacity) is ``full``: it keeps
    #: serving and counting its copies, and placement gives it nothing new.
    high_watermark: float = 0.90
    #: A storage worker unseen for this long is ``down``.
    worker_down_seconds: float = 30.0
    #: The scheduler probes storage workers and checks leases this often.
    tick_seconds: float = 2.0
    #: The scheduler's leader runs SQLite's ``PRAGMA optimize`` (fresh planner statistics as
    #: the catalog grows) when it starts and then this often; 0: never. PostgreSQL's
    #: autovacuum keeps its own.
    optimize_hours: float = 6.0
    #: A status probe that gets no byte of an answer for this long is that worker's failure
    #: (a peer that accepts and never answers costs each tick at most this).
    probe_seconds: float = 10.0
    #: A transfer (an upload, a chain hop, a copy between workers) fails once no byte moved
    #: for this long, never after a fixed total: a slow link that keeps moving is never cut.
    #: Through a chain each hop waits this long per worker after it, so the hop before a
    #: stalled one gives up first and names it (docs/design.md, "Deadlines by progress").
    stall_seconds: float = 60.0
    #: This machine's id among the training hosts: checkpoints it detects are its own, and the
    #: steps that touch their local files run here only (docs/design.md, "Hosts"). Empty: the id
    #: kept in ``<home>/host-id``, written with the hostname the first time (pipeline/hostid.py),
    #: so a later hostname change keeps the host. Set it when several hosts share one home.
    host: str = ""
    #: Directories a restore may write under besides the watched roots themselves (and, for the
    #: CLI and the Python API, the caller's current directory). docs/design.md, invariant 7.
    restore_roots: tuple[str, ...] = ()
    #: Static storage workers (URLs), for networks without multicast.
    workers: tuple[str, ...] = ()
    #: Object-store targets (S3-compatible buckets), as JSON; in config.toml, ``[[targets]]``
    #: tables (pipeline/objectstore/config.py). Never a credential: those come from the AWS
    #: environment, a profile or an instance role.
    targets: str = ""
    #: Copies of each content on object stores, when ``[[targets]]`` are configured (per run,
    #: ``target_copies`` in a ``[runs."<glob>"]`` table); 0: none.
    target_copies: int = 1
    #: ``lag``: the object-store copies are made beside the workers' and rotation does not wait
    #: for them (status shows how far they lag); ``required``: a local copy goes only once they
    #: are confirmed too. Per run, ``target_mode``.
    target_mode: str = "lag"
    #: Shared secret of the cluster; empty means ``<home>/cluster.key`` (created on first use).
    cluster_key: str = ""
    #: Largest accepted difference between a request's timestamp and the worker's clock.
    clock_skew_seconds: float = 300.0
    #: A storage worker refuses (413) an upload declared larger than this.
    worker_max_upload: int = 64 * 1024 * MiB
    #: How a content's RF copies leave the host that holds its file: ``chain`` sends it once,
    #: to the first worker, which streams it on to the next as it arrives (workers/chain.py);
    #: ``fanout`` sends it to each worker from the host. docs/design.md, "Replication".
    replication: str = "chain"
    #: Shard bytes sent to or fetched from a worker on another host: ``auto`` compresses them
    #: when the link measured slower than the compressor, the host has cores to spare and the
    #: shard compresses; ``on`` whenever the shard compresses; ``off`` never. A worker answers
    #: a download compressed by the same rule. pipeline/cluster/wire.py.
    wire_compression: str = "auto"
    #: The frames compressed bytes travel in, from this host: ``planes`` (tensors split into
    #: byte planes; zstd frames to a worker that does not decode them) or ``zstd`` (zstd frames
    #: only, the previous release's wire: a comparison, or a rollback).
    wire_codec: str = "planes"
    #: Dramatiq time limit for one shard transfer, in seconds.
    transfer_time_limit: float = 3600.0
    #: Retries of a failing actor message before it is dead-lettered.
    max_retries: int = 5
    #: Smallest and largest retry backoff, in milliseconds.
    min_backoff_ms: int = 1000
    max_backoff_ms: int = 60_000
    #: When the nightly scrub runs (cron, in the machine's local time); empty disables it.
    scrub_cron: str = "30 2 * * *"
    #: Read rate of a scrub on one storage worker, bytes per second (0: unthrottled).
    scrub_rate: int = 200 * MiB
    #: Shards re-hashed per scrub request; the cursor is saved after each batch.
    scrub_batch: int = 64
    #: A scrub of an object store reads back this fraction of each object's ranges (the first
    #: and the last always; lengths checked: readable and whole), beside the store's checksum;
    #: 1.0 reads every byte and checks its SHA-256. Reading a whole bucket back every night
    #: costs its size in egress: docs/design.md, "Object-store targets".
    target_scrub_sample: float = 0.1
    #: Each object is read back whole (SHA-256 checked) by one nightly scrub in this many: the
    #: objects of a day's turn (by hash), 1/N of the bucket a night. 0: only the sample.
    target_scrub_full_days: int = 7
    #: Read rate of a scrub on one object store, bytes per second (0: unthrottled).
    target_scrub_rate: int = 200 * MiB
    #: When the scheduled garbage collection runs (cron, local time); empty disables it.
    gc_cron: str = "30 3 * * *"
    #: Content no kept checkpoint references is collected only after this long unreferenced.
    gc_grace_seconds: float = 3600.0
    #: Copies deleted per request to a worker, and the most deleted per second (0: unthrottled).
    gc_batch: int = 200
    gc_rate: float = 500.0
    #: An object in a target's bucket that no copy row names (a put whose answer was lost, a
    #: home restored from an older database) is deleted only once the store says it was written
    #: this long ago: a put in flight (a `ckpt target add` probe, another process's upload) and
    #: a listing that lags are never mistaken for garbage (docs/design.md, "Garbage collection").
    gc_orphan_grace_seconds: float = 86400.0
    #: Alerts (pipeline/alerts.py): a condition becomes an alert once it has held this long. A
    #: storage worker down or rejected; content short of RF good copies; a run whose newest save
    #: is not protected, or whose trainer's saves cannot be protected (pipeline/degraded.py).
    #: A disk (one filesystem, however many workers share it) above the high watermark. Content
    #: lost and dead letters are alerts at once.
    alert_worker_down_seconds: float = 300.0
    alert_under_replicated_seconds: float = 3600.0
    alert_unprotected_seconds: float = 3600.0
    alert_disk_full_seconds: float = 300.0
    #: A disk's alert, once open, holds until its disk is this far below the high watermark
    #: (0.05: open above 90 % full, resolved below 85 %): a disk hovering at the mark is one alert.
    alert_disk_clear_margin: float = 0.05
    #: An open alert is resolved (one that has not fired yet, dropped) only once its condition has
    #: not been found for this long; found again meanwhile, it is the same occurrence: a worker
    #: answering every other probe is one alert, not one per probe.
    alert_clear_seconds: float = 120.0
    #: A storage worker's scrub is overdue when none finished within this long after the time
    #: the scrub schedule (``scrub_cron``) made it due.
    alert_scrub_grace_seconds: float = 12 * 3600.0
    #: A URL the scheduler POSTs JSON to when an alert fires and when it is resolved, signed with
    #: the cluster key (pipeline/webhook.py); empty: none.
    alert_webhook: str = ""
    #: Browse mDNS for storage workers (``_ckpt-store._tcp.local.``).
    mdns: int = 1
    #: Addresses zeroconf uses, comma-separated, or "all"; loopback only by default.
    mdns_interfaces: tuple[str, ...] = ("127.0.0.1",)
    #: Set by ``ckpt up`` for its children: where each service says it is ready
    #: (pipeline.service.readiness). Empty otherwise.
    ready_dir: str = ""
    #: Where the web UI listens (``ckpt up`` and ``ckpt web``).
    web_host: str = "127.0.0.1"
    web_port: int = 8080

    # -- derived values -------------------------------------------------------------

    @property
    def host_id(self) -> str:
        """This machine's id among the training hosts: ``CKPT_HOST``, else the one kept in
        ``<home>/host-id`` (pipeline/hostid.py); the hostname is only its label."""
        return hostid.host_id(self.home, self.host)

    @property
    def host_label(self) -> str:
        """What this machine is called now (its hostname), shown beside :attr:`host_id`."""
        return hostid.label()

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'ckpt.db').resolve()}"

    @property
    def embedded_redis(self) -> bool:
        return not self.redis_url

    @property
    def redis_socket(self) -> Path:
        return (self.home / "redis" / "redis.sock").resolve()

    @property
    def broker_url(self) -> str:
        return self.redis_url or f"unix://{self.redis_socket}"

    def options_for(self, root: str | None) -> RootOptions:
        """The completion options of one root: its overrides over the global settings."""
        over: dict[str, Any] = {}
        if root is not None and self.root_options:
            over = json.loads(self.root_options).get(root, {})
        return RootOptions(quiet_seconds=float(over.get("quiet_seconds", self.quiet_seconds)),
                           commit_marker=str(over.get("commit_marker", self.commit_marker)),
                           replication=str(over.get("replication", self.replication)))

    def policy_for(self, run: str) -> Policy:
        """The remote retention policy of ``run``: the first ``[runs."<glob>"]`` table that
        matches it over the global ``remote_*`` settings."""
        return self.policy_with(self.run_table(run)[1])

    def run_table(self, run: str) -> tuple[str | None, dict[str, Any]]:
        """The first ``[runs."<glob>"]`` table matching ``run``: its glob and its options
        (``(None, {})``: none matches, the global ``remote_*`` settings decide)."""
        for pattern, opts in _tables_of(self.run_options).items():
            if fnmatch.fnmatchcase(run, pattern) or run == pattern.rstrip("/"):
                return pattern, opts
        return None, {}

    def policy_with(self, over: Mapping[str, Any]) -> Policy:
        """The global remote policy with the options of one ``[runs."<glob>"]`` table over it."""
        return Policy(
            keep_last=int(over.get("keep_last", self.remote_keep_last)),
            keep_every=int(over.get("keep_every", self.remote_keep_every)),
            hourly=int(over.get("keep_hourly", self.remote_keep_hourly)),
            daily=int(over.get("keep_daily", self.remote_keep_daily)),
            weekly=int(over.get("keep_weekly", self.remote_keep_weekly)),
            monthly=int(over.get("keep_monthly", self.remote_keep_monthly)),
            best=int(over.get("keep_best", self.remote_keep_best)),
            metric=str(over.get("best_metric", self.remote_best_metric)),
            mode=str(over.get("best_mode", self.remote_best_mode)),
        )

    def need_for(self, run: str) -> Need:
        """The good copies each content of ``run`` needs before its local copy may go: RF on
        storage workers and, in ``required`` mode, its object-store copies too."""
        copies, mode = self.target_policy(run)
        return Need(self.rf_for(run), copies if mode == "required" else 0)

    def rf_for(self, run: str) -> int:
        """The replication factor on storage workers of ``run``: its ``[runs."<glob>"]`` table's
        ``rf`` over the global one."""
        return int(self.run_table(run)[1].get("rf", self.rf))

    def rf_per_run(self) -> bool:
        """Whether a ``[runs."<glob>"]`` table sets another ``rf`` than the global one (else every
        content's RF is the global one, and no query needs to ask which runs reference it)."""
        return any(int(o.get("rf", self.rf)) != self.rf for o in _tables_of(self.run_options).values())

    def rf_said(self) -> str:
        """The RF of contents, as a message says it: the number, or "their RF" when runs set their own."""
        return "their RF" if self.rf_per_run() else str(self.rf)

    def target_policy(self, run: str) -> tuple[int, str]:
        """``(copies, mode)`` on object stores for ``run`` (no copies when no target is configured)."""
        over = self.run_table(run)[1]
        copies = int(over.get("target_copies", self.target_copies)) if self.object_targets() else 0
        return copies, str(over.get("target_mode", self.target_mode))

    def object_targets(self) -> list[targets_config.Target]:
        """The object-store targets (``[[targets]]``), validated (parsed once per text: the
        tier policy asks for them per checkpoint a page shows)."""
        return list(_targets_of(self.targets))

    @property
    def wire_codecs(self) -> tuple[str, ...]:
        """The frames this host sends compressed bytes in and asks downloads in, best first."""
        return WIRE_CODECS[self.wire_codec]

    def key(self) -> bytes:
        """The cluster key, creating ``<home>/cluster.key`` (mode 0600) on first use."""
        if self.cluster_key:
            return self.cluster_key.encode()
        return self.secret("cluster.key")

    def admin_token(self) -> str:
        """The web UI's admin token, ``<home>/admin.token`` (created on first start)."""
        return self.secret("admin.token").decode()

    def secret(self, name: str) -> bytes:
        """A random secret kept in ``<home>/<name>`` (mode 0600), created on first use."""
        path = self.home / name
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            write_once(path, secrets.token_hex(32), 0o600)  # invariant 2: the key survives a crash once used
        return path.read_text().strip().encode()

    def child_env(self) -> dict[str, str]:
        """Environment that makes a child process build these same settings."""
        env = {
            "CKPT_HOME": str(self.home.resolve()),
            "CKPT_DATABASE_URL": self.db_url,
            "CKPT_REDIS_URL": self.broker_url,
            "CKPT_CLUSTER_KEY": self.key().decode(),
        }
        for f in dataclasses.fields(self):
            if f.name in ("home", "database_url", "redis_url", "cluster_key"):
                continue
            value = getattr(self, f.name)
            env[f"CKPT_{f.name.upper()}"] = ",".join(value) if isinstance(value, tuple) else str(value)
        return env


@functools.lru_cache(maxsize=8)
def _tables_of(run_options: str) -> dict[str, dict[str, Any]]:
    """The ``[runs."<glob>"]`` tables of ``run_options``, parsed once (asked per checkpoint by status)."""
    return json.loads(run_options) if run_options else {}


#: Text settings whose empty value means something ("disabled", "the default"): an empty
#: ``CKPT_*`` variable gives it (and so overrides config.toml and what ``ckpt up`` recorded).
EMPTY_IS_A_VALUE = frozenset({"scrub_cron", "gc_cron", "alert_webhook", "database_url", "redis_url", "cluster_key",
                              "host"})


def _kind(name: str) -> str:
    """A setting's type as its annotation names it: ``str``, ``int``, ``float``, ``Path``, ``tuple``."""
    f = {f.name: f for f in dataclasses.fields(Settings)}[name]
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return "tuple" if kind.startswith("tuple") else kind


def _coerce(name: str, raw: Any) -> Any:
    kind = _kind(name)
    try:
        if kind.startswith("tuple"):
            if isinstance(raw, str):
                return tuple(p.strip() for p in raw.split(",") if p.strip())
            return tuple(str(p) for p in raw)
        if kind == "Path":
            return Path(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"setting {name}: {raw!r} is not a valid {kind}") from exc


#: The ways copies are sent (``Settings.replication``).
REPLICATION = ("chain", "fanout")
#: ``wire_codec`` -> the frames this host sends and asks for, best first (pipeline/cluster/wire.py).
WIRE_CODECS = {"planes": ("planes", "zstd"), "zstd": ("zstd",)}


def load(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None, *,
         recorded: bool = True) -> Settings:
    """Build the settings (see :func:`explain`)."""
    return explain(overrides, environ, recorded=recorded)[0]


def explain(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None, *,
            recorded: bool = True) -> tuple[Settings, dict[str, str]]:
    """The settings, and where each value came from: defaults < ``<home>/config.toml`` < what the
    running ``ckpt up`` records (pipeline/effective.py; not with ``recorded=False``: ``ckpt up``
    itself) < ``CKPT_*`` env < ``overrides``.

    ``overrides`` holds flag values; ``None`` values are ignored so unset flags fall through.
    Relative paths (roots, restore roots, the roots of ``[roots."<root>"]`` and ``[runs."<glob>"]``
    tables) become absolute: from this process's directory for flags and env, from the directory
    that holds the home for config.toml, so that every command and service compares the same
    paths wherever it runs.
    """
    env = os.environ if environ is None else environ
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    names = {f.name for f in dataclasses.fields(Settings)}
    unknown = set(overrides) - names
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")

    found = home_mod.find(overrides.get("home"), env)
    home = found.path
    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in names}
    here = Path.cwd()

    def put(name: str, raw: Any, source: str, base: Path) -> None:
        values[name] = _absolute(name, _coerce(name, raw), base)
        sources[name] = source

    config = home / "config.toml"
    if config.exists():
        data = read_config(config.read_text(), config)
        for k, v in data.items():
            if k == "roots" and isinstance(v, dict):  # [roots."<root>"] tables: per-root options
                put("root_options", _root_options(v, str(config)), "config.toml", home.parent)
                continue
            if k == "runs" and isinstance(v, dict):  # [runs."<glob>"] tables: per-run retention
                put("run_options", _run_options(v, str(config)), "config.toml", home.parent)
                continue
            if k == "targets":  # [[targets]]: object stores
                put("targets", targets_config.to_json(targets_config.parse_targets(v, str(config))), "config.toml",
                    home.parent)
                continue
            if k not in names:
                raise ConfigError(f"{config}: unknown setting {k!r}")
            put(k, v, "config.toml", home.parent)
        secret = [k for k in ("database_url", "redis_url", "cluster_key") if data.get(k)
                  and (k == "cluster_key" or masked_url(str(data[k])) != str(data[k]))]
        if secret and config.stat().st_mode & 0o077:
            logging.getLogger("ckpt.settings").warning(
                "%s holds %s and other users can read it: chmod 600 %s", config, " and ".join(secret), config)
    record = effective.read(home) if recorded else None
    if record is not None and record.ignored:
        effective.say_ignored(record)
    if record is not None and not record.ignored:
        for k, v in record.values.items():
            if k in names and k not in effective.NOT_RECORDED:
                put(k, v, f"ckpt up ({record.sources.get(k, 'default')})", home.parent)
    for name in names:
        raw = env.get(f"CKPT_{name.upper()}")
        # Set but empty: the empty value where empty means something (`CKPT_SCRUB_CRON=` disables
        # the scrub, `CKPT_RESTORE_ROOTS=` names none, over what `ckpt up` recorded); for any
        # other setting (a number, a path, a choice) empty is taken as not given.
        if raw is not None and (raw != "" or name in EMPTY_IS_A_VALUE or _kind(name) == "tuple"):
            put(name, raw, "env", here)
    for k, v in overrides.items():
        put(k, v, "flag", here)
    sources["home"] = found.source
    values["home"] = home
    if record is not None and not record.ignored:
        _same_control_plane(record, values, sources, home)
    s = Settings(**values)
    _check_urls(s)
    if s.rf < 1:
        raise ConfigError(f"rf must be at least 1, got {s.rf}")
    if s.keep_last < 0:
        raise ConfigError(f"keep_last must be >= 0, got {s.keep_last}")
    if s.replication not in REPLICATION:
        raise ConfigError(f"replication must be one of {', '.join(REPLICATION)}, got {s.replication!r}")
    if s.wire_compression not in ("auto", "on", "off"):
        raise ConfigError(f"wire_compression must be auto, on or off, got {s.wire_compression!r}")
    if s.wire_codec not in WIRE_CODECS:
        raise ConfigError(f"wire_codec must be one of {', '.join(WIRE_CODECS)}, got {s.wire_codec!r}")
    if s.root_options:
        try:
            parsed = json.loads(s.root_options)
        except ValueError as exc:
            raise ConfigError(f"root_options: not JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ConfigError("root_options must map each root to its options")
        for root, opts in json.loads(_root_options(parsed, "root_options")).items():
            if opts.get("replication", "chain") not in REPLICATION:
                raise ConfigError(f"roots.{root!r}.replication must be one of {', '.join(REPLICATION)}, "
                                  f"got {opts['replication']!r}")
    if s.run_options:
        try:
            parsed = json.loads(s.run_options)
        except ValueError as exc:
            raise ConfigError(f"run_options: not JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ConfigError("run_options must map each run glob to its options")
        _run_options(parsed, "run_options")
    _check_policy(s.policy_with({}), "remote retention")
    for pattern, opts in json.loads(s.run_options or "{}").items():
        _check_policy(s.policy_with(opts), f"runs.{pattern!r}")
        if int(opts.get("rf", 1)) < 1:
            raise ConfigError(f"runs.{pattern!r}.rf must be at least 1, got {opts['rf']}")
    configured = len(s.object_targets())
    for where, opts in [("", {}), *[(f"runs.{p!r}.", o) for p, o in json.loads(s.run_options or "{}").items()]]:
        copies = int(opts.get("target_copies", s.target_copies))
        mode = str(opts.get("target_mode", s.target_mode))
        if mode not in ("lag", "required"):
            raise ConfigError(f"{where}target_mode must be lag or required, got {mode!r}")
        if not 0 <= copies <= max(configured, 1):
            raise ConfigError(f"{where}target_copies must be between 0 and the number of [[targets]] "
                              f"({configured}), got {copies}")
    if not 0 < s.target_scrub_sample <= 1:
        raise ConfigError(f"target_scrub_sample must be in (0, 1], got {s.target_scrub_sample}")
    if s.target_scrub_full_days < 0 or s.target_scrub_rate < 0:
        raise ConfigError("target_scrub_full_days and target_scrub_rate must be >= 0")
    if not 0 < s.high_watermark <= 1:
        raise ConfigError(f"high_watermark must be in (0, 1], got {s.high_watermark}")
    if not 0 <= s.alert_disk_clear_margin < s.high_watermark:
        raise ConfigError(f"alert_disk_clear_margin must be in [0, high_watermark), got {s.alert_disk_clear_margin}")
    if s.alert_clear_seconds < 0:
        raise ConfigError(f"alert_clear_seconds must be >= 0, got {s.alert_clear_seconds}")
    if s.quiet_seconds < 0:
        raise ConfigError(f"quiet_seconds must be >= 0, got {s.quiet_seconds}")
    if s.shard_size < 4096:
        raise ConfigError(f"shard_size must be at least 4096 bytes, got {s.shard_size}")
    if s.poll_ms < 10:
        raise ConfigError(f"poll_ms must be at least 10, got {s.poll_ms}")
    if s.hash_threads < 1:
        raise ConfigError(f"hash_threads must be at least 1, got {s.hash_threads}")
    priority.of(s.nice, s.ionice)  # raises ConfigError naming the bad value
    if s.max_hash_bytes < 0 or not 0 <= s.sparse_ratio < 1:
        raise ConfigError(f"max_hash_bytes must be >= 0 and sparse_ratio in [0, 1), got {s.max_hash_bytes}"
                          f" and {s.sparse_ratio}")
    return s, sources


#: What each URL ``ckpt up`` may run with is, in a message.
_URLS = {"database_url": "database", "redis_url": "broker"}


def read_config(text: str, path: Path) -> dict[str, Any]:
    """The text of config.toml at ``path``, parsed; a mistake names its line and column."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _same_control_plane(record: effective.Record, values: Mapping[str, Any], sources: Mapping[str, str],
                        home: Path) -> None:
    """Refuse settings that would use another control plane than the running ``ckpt up``: it
    runs with a URL whose password its record masks (so the URL is not loaded from it), and
    this command was given none of its own (env or flag) and has no equal one in config.toml.
    Without this, the command would use the home's own SQLite file and embedded Redis: a
    second, empty control plane."""
    for name, what in _URLS.items():
        hidden = record.masked.get(name)
        if hidden and sources[name] not in ("env", "flag") and masked_url(str(values.get(name, ""))) != hidden:
            raise ConfigError(f"`ckpt up` of home {home} runs with {what} {hidden}: set CKPT_{name.upper()} to the "
                              "same URL in this shell")


#: The characters a password must not hold unencoded, per URL: SQLAlchemy ends it at the first
#: ``@``; redis-py (urllib) at any of them.
_BREAK_URLS = {"database_url": "@", "redis_url": "@/?#"}


def _check_urls(s: Settings) -> None:
    """Refuse a URL whose password its driver would cut short (and show a piece of in its errors),
    and a storage worker URL with a password: workers authenticate with the cluster key, and
    their URLs are shown as they are (logs, ``ckpt status``, the web UI, /metrics)."""
    for url in s.workers:
        if masked_url(url) != url:
            raise ConfigError(f"workers: {masked_url(url)} holds a password; storage workers need none (the "
                              "cluster key authenticates them): give the URL without it")
    for name, breaks in _BREAK_URLS.items():
        url = str(getattr(s, name))
        raw = [ch for ch in masking.raw_in_password(url) if ch in breaks]
        if raw:
            codes = ", ".join(f"{ch} as %{ord(ch):02X}" for ch in raw)
            raise ConfigError(f"{name} {masked_url(url)}: percent-encode {codes} in its password "
                              "(urllib.parse.quote(password, safe='')); unencoded, its driver reads a piece of "
                              "it as the host")


#: Settings that hold paths: a relative one is made absolute as it is read (:func:`explain`).
PATHS = ("roots", "restore_roots")


def absolute_path(path: str, base: Path) -> str:
    """``path`` (a directory or a glob; ``~`` expanded) from ``base`` when it is relative."""
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _absolute(name: str, value: Any, base: Path) -> Any:
    if name in PATHS:
        return tuple(absolute_path(p, base) for p in value)
    if name in ("root_options", "run_options") and value:
        try:
            tables = json.loads(value)
        except ValueError:
            return value  # load() names the mistake
        if not isinstance(tables, dict):
            return value
        # A run glob that starts with a wildcard (``*/llama-*``) matches anywhere: left as it is.
        return json.dumps({k if name == "run_options" and k.startswith(("*", "?", "["))
                           else absolute_path(k, base): v for k, v in tables.items()}, sort_keys=True)
    return value


_ROOT_KEYS: dict[str, type] = {"quiet_seconds": float, "commit_marker": str, "replication": str}
_RUN_KEYS: dict[str, type] = {"keep_last": int, "keep_every": int, "keep_hourly": int, "keep_daily": int,
                              "keep_weekly": int, "keep_monthly": int, "keep_best": int, "best_metric": str,
                              "best_mode": str, "target_copies": int, "target_mode": str, "rf": int}


def _root_options(tables: dict[str, Any], where: str) -> str:
    """Validate ``[roots."<root>"]`` tables; the JSON form Settings keeps."""
    return _tables(tables, where, "roots", _ROOT_KEYS)


def _run_options(tables: dict[str, Any], where: str) -> str:
    """Validate ``[runs."<glob>"]`` tables; the JSON form Settings keeps."""
    return _tables(tables, where, "runs", _RUN_KEYS)


def _tables(tables: dict[str, Any], where: str, section: str, allowed: dict[str, type]) -> str:
    out: dict[str, dict[str, Any]] = {}
    for name, opts in tables.items():
        if not isinstance(opts, dict):
            raise ConfigError(f"{where}: {section}.{name!r} must be a table of options")
        for k, v in opts.items():
            if k not in allowed:
                raise ConfigError(f"{where}: {section}.{name!r}: unknown option {k!r} (known: {', '.join(allowed)})")
            try:
                out.setdefault(name, {})[k] = allowed[k](v)
            except (TypeError, ValueError) as exc:
                kind = allowed[k].__name__
                raise ConfigError(f"{where}: {section}.{name!r}.{k}: {v!r} is not a valid {kind}") from exc
    return json.dumps(out, sort_keys=True)


def _check_policy(p: Policy, where: str) -> None:
    counts = (p.keep_last, p.keep_every, p.hourly, p.daily, p.weekly, p.monthly, p.best)
    if any(n < 0 for n in counts):
        raise ConfigError(f"{where}: keep counts must be >= 0")
    if p.mode not in ("min", "max"):
        raise ConfigError(f"{where}: best_mode must be min or max, got {p.mode!r}")
    if p.best and not p.metric:
        raise ConfigError(f"{where}: keep_best needs best_metric (a name in trainer_state.json's log_history, "
                          "e.g. eval_loss)")


_current: Settings | None = None


def current() -> Settings:
    """The process-wide settings, loaded from the environment on first use."""
    global _current
    if _current is None:
        _current = load()
    return _current


def configure(settings: Settings) -> Settings:
    """Replace the process-wide settings (entry points and tests)."""
    global _current
    _current = settings
    return settings


@functools.lru_cache(maxsize=16)
def _targets_of(text: str) -> tuple[targets_config.Target, ...]:
    return tuple(targets_config.from_json(text))
