"""``python -m bench`` (or ``./dev bench``): the benchmark of ckpt-pipeline.

Runs the real system (``ckpt up``: embedded Redis, dramatiq workers, 3 storage workers on
loopback, RF 2) on checkpoints it generates, prints one table and saves it as JSON: the data
path at several sizes, HF and DCP folders, the control plane, a month of training under a
retention policy (bench/month.py, its chart saved as bench/results/month.png), and the
control plane at 100k checkpoints and 1M job events (bench/scale.py), and the cluster in a
box: a trainer and four storage hosts on links shaped to 100 Mbit and 1 Gbit, fan-out and
chain replication side by side (bench/cluster.py); and what protection costs a training run
(``--parts training``: step times off, watching, with the callbacks; bench/training.py); and a
checkpoint to a real S3 server and back beside boto3's transfer manager (``--parts s3``: SeaweedFS
on loopback; bench/s3.py); and byte-grouped compression side by side with plain zstd and zipnn
(``--parts codec``; bench/codec.py); and checkpoints per second to protected at 1,000 saves with
keep-last rotation on (``--parts throughput``, bench/throughput.py); and store and restore side by
side with smoltorrent on loopback (``--parts smoltorrent --smoltorrent-dir PATH``, a checkout of it;
bench/smoltorrent.py).
Options: ``--sizes 0.1,1,4`` (GiB), ``--parts sizes,dirs,control,month,scale,cluster,throughput``,
``--month-saves N``, ``--cluster-rates 100mbit,1gbit``, ``--cluster-gib 1``,
``--cluster-modes fanout,chain,chain+planes`` (``chain+zstd``: the same with zstd frames, the previous
default's wire; ``chain+s3``: chain with an object store on a host of its own as a required target),
``--training-steps N``,
``--training-save-every N``, ``--s3-gib 1``, ``--codec-gib 1``, ``--out FILE``, ``--keep`` (keep the work directory).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import (
    cluster,
    codec,
    layouts,
    limits,
    loading,
    month,
    s3,
    scale,
    smoltorrent,
    throughput,
    training,
    transitions,
)
from bench.system import System, replica_files, restore, store

GiB = layouts.GiB


def used_bytes(system: System) -> int:
    from pipeline.cluster import auth
    from pipeline.cluster.client import WorkerClient

    info = json.loads((system.home / "up.json").read_text())
    return sum(WorkerClient(u, system.settings.key(), auth.ANY_NODE).status()["used"] for u in info["workers"])


def _store_limit(system: System, path: Path, work: Path) -> float:
    hash_s, _ = limits.sha256_seconds(path)
    return hash_s + limits.write_copies_seconds(path, work / "scratch", system.settings.rf)


def measure_size(work: Path, gib: float) -> dict:
    target = int(gib * GiB)
    res: dict = {"size_gib": gib}
    with System(work / f"sys-{gib}", CKPT_SETTLE_SECONDS="3600", CKPT_SCRUB_RATE="0") as system:
        run = system.runs / "run"
        run.mkdir()
        t = time.perf_counter()
        path = layouts.write_file(layouts.decoder(target, seed=1), run / "step_1.safetensors")
        limits.flush(path)
        res["generate_s"] = time.perf_counter() - t
        size = path.stat().st_size
        res["bytes"] = size
        # Each limit is measured just before and just after what it bounds, and the two are
        # averaged: this VM's disk speed drifts by up to 2x within minutes.
        source_sha = limits.sha256_seconds(path)[1]
        store_limits = [_store_limit(system, path, work)]
        before = used_bytes(system)
        s = store(system, path)
        res["store_s"], res["store_cli_rss_kib"] = s["seconds"], s["cli_rss_kib"]
        sent_first = used_bytes(system) - before
        store_limits.append(_store_limit(system, path, work))
        res["limit_store_runs_s"] = store_limits
        res["limit_store_s"] = statistics.mean(store_limits)

        copies = replica_files(system, s["checkpoint_id"])
        restore_limits = [limits.restore_limit_seconds(copies, work / "scratch")]
        dest = work / "restored.safetensors"
        r = restore(system, s["checkpoint_id"], dest)
        res["restore_s"], res["restore_cli_rss_kib"] = r["seconds"], r["cli_rss_kib"]
        res["restore_identical"] = limits.sha256_seconds(dest)[1] == source_sha
        dest.unlink()
        restore_limits.append(limits.restore_limit_seconds(copies, work / "scratch"))
        res["limit_restore_runs_s"] = restore_limits
        res["limit_restore_s"] = statistics.mean(restore_limits)

        # Both loads in a fresh process, from the disk (page cache dropped): the replicas
        # for load_state_dict, the original file for load_file.
        every_copy = sorted(system.home.glob("workers/*/shards/*/*/*"))
        res["load_state_dict_s"] = loading.best_of(2, "state_dict", str(s["checkpoint_id"]), system.env, every_copy)
        res["load_file_lazy_s"] = loading.best_of(2, "file", str(path), system.env, [path], "--lazy")
        res["load_file_s"] = loading.best_of(2, "file", str(path), system.env, [path])

        # A second step of the same run in which half the tensors did not change.
        hidden, layers, _ = layouts.shape_for(target)
        second = layouts.write_file(layouts.decoder(target, seed=2, changed_from_layer=layers // 2, base_seed=1),
                                    run / "step_2.safetensors")
        limits.flush(second)
        before = used_bytes(system)
        store(system, second)
        res["sent_second_fraction"] = (used_bytes(system) - before) / max(1, sent_first)

        seconds, _, out = system.cli("scrub", "--wait")
        scrubs = [system.job(int(m)) for m in re.findall(r"scrub job (\d+)", out)]
        res["scrub_gb_per_s_per_worker"] = statistics.mean(
            j.bytes_done / 1e9 / max(1e-6, (j.finished_at - j.created_at).total_seconds()) for j in scrubs)
        res["peak_rss_kib"] = system.processes()
        res["peak_rss_kib"]["ckpt store (CLI)"] = res["store_cli_rss_kib"]
        res["peak_rss_kib"]["ckpt restore (CLI)"] = res["restore_cli_rss_kib"]
        for p in run.iterdir():
            p.unlink()
    return res


def measure_dirs(work: Path, gib: float) -> dict:
    """Store and restore an HF-style folder and a DCP folder of about ``gib``."""
    out = {}
    with System(work / "sys-dirs", CKPT_SETTLE_SECONDS="3600") as system:
        run = system.runs / "run"
        run.mkdir()
        sd = layouts.decoder(int(gib * GiB), seed=3)
        for kind, writer in (("hf", layouts.write_hf), ("dcp", layouts.write_dcp)):
            path = writer(sd, run / f"{kind}-step_1")
            limits.flush(path)
            s = store(system, path)
            dest = work / f"{kind}-restored"
            r = restore(system, s["checkpoint_id"], dest)
            same = all((dest / p.relative_to(path)).read_bytes() == p.read_bytes()
                       for p in path.rglob("*") if p.is_file())
            out[kind] = {"bytes": layouts.size_of(path), "store_s": s["seconds"], "restore_s": r["seconds"],
                         "identical": same}
            shutil.rmtree(dest)
    return out


def measure_control_plane(work: Path) -> dict:
    """Detection latency (default settings), 200 x 1 MiB checkpoints, transition latency.

    The checkpoints are safetensors files a trainer renames into place: detection proves
    them complete from their header and size. (An opaque file cannot be proven complete:
    it waits for a commit marker or the quiet period, docs/design.md, section 2.)
    """
    import torch
    from sqlalchemy import func, select

    from pipeline.db.engine import session_scope
    from pipeline.db.models import Checkpoint, Job

    res: dict = {}
    with System(work / "sys-cp") as system:
        run = system.runs / "run"
        run.mkdir()
        renamed: dict[str, float] = {}
        def one_mib(seed: int) -> dict[str, torch.Tensor]:
            return {"w": torch.randint(-2**31, 2**31 - 1, (1 << 18,), dtype=torch.int32,
                                       generator=torch.Generator().manual_seed(seed))}

        for i in range(20):
            p = layouts.write_file(one_mib(i), run / f"lat_{i:03d}.safetensors")
            renamed[str(p)] = time.time()
            time.sleep(0.25)
        deadline = time.monotonic() + 60
        lat = []
        while time.monotonic() < deadline:
            with session_scope(system.settings.db_url) as s:
                rows = {c.path: c.detected_at.timestamp() for c in s.scalars(select(Checkpoint))}
            if all(p in rows for p in renamed):
                lat = [rows[p] - t for p, t in renamed.items()]
                break
            time.sleep(0.2)
        res["detect_p50_s"] = statistics.median(lat) if lat else None
        res["detect_max_s"] = max(lat) if lat else None

        run2 = system.runs / "many"
        run2.mkdir()
        t0 = time.time()
        for i in range(200):
            layouts.write_file(one_mib(1000 + i), run2 / f"c_{i:04d}.safetensors")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with session_scope(system.settings.db_url) as s:
                n = s.scalar(select(func.count(Job.id)).join(Checkpoint, Job.checkpoint_id == Checkpoint.id)
                             .where(Checkpoint.run == str(run2), Job.state == "verified"))
            if n == 200:
                break
            time.sleep(0.2)
        res["cp_200_seconds"] = time.time() - t0
        res["cp_checkpoints_per_s"] = 200 / res["cp_200_seconds"] if n == 200 else None

        with multiprocessing.get_context("spawn").Pool(4) as pool:
            lat = [x for part in pool.map(transitions.run, [(system.settings.db_url, 50)] * 4) for x in part]
        lat.sort()
        res["transition_p50_ms"] = 1000 * lat[len(lat) // 2]
        res["transition_p99_ms"] = 1000 * lat[int(len(lat) * 0.99)]
    return res


def table(sizes: list[dict], dirs: dict, cp: dict) -> str:
    rows = []

    def row(name: str, fn, fmt: str = "{:.2f}", target: str = "") -> None:
        vals = []
        for r in sizes:
            try:
                v = fn(r)
                vals.append(fmt.format(v) if v is not None else "-")
            except (KeyError, ZeroDivisionError, TypeError):
                vals.append("-")
        rows.append((name, vals, target))

    row("checkpoint GiB", lambda r: r["bytes"] / GiB)
    row("store s", lambda r: r["store_s"])
    row("store limit s (sha once + RF fsynced copies)", lambda r: r["limit_store_s"])
    row("  limit before / after the store", lambda r: "{:.2f} / {:.2f}".format(*r["limit_store_runs_s"]), "{}")
    row("store / limit", lambda r: r["store_s"] / r["limit_store_s"], target="<= 1.5")
    row("store s per GiB", lambda r: r["store_s"] / (r["bytes"] / GiB))
    row("restore s", lambda r: r["restore_s"])
    row("restore limit s (read cold + hash + fsynced write)", lambda r: r["limit_restore_s"])
    row("  limit before / after the restore", lambda r: "{:.2f} / {:.2f}".format(*r["limit_restore_runs_s"]), "{}")
    row("restore / limit", lambda r: r["restore_s"] / r["limit_restore_s"], target="<= 1.5")
    row("restore byte-identical", lambda r: r["restore_identical"], "{}")
    row("load_state_dict s (cold cache, fresh process)", lambda r: r["load_state_dict_s"])
    row("load_file s (cold, tensors in memory)", lambda r: r["load_file_s"])
    row("load_file s (cold, lazy: mmap)", lambda r: r["load_file_lazy_s"], "{:.3f}")
    row("load_state_dict / load_file in memory", lambda r: r["load_state_dict_s"] / r["load_file_s"], target="<= 2")
    row("max peak RSS MiB (any process)", lambda r: max(r["peak_rss_kib"].values()) / 1024, "{:.0f}", "<= 256")
    def peak_of(prefix: str):
        return lambda r: max(v for k, v in r["peak_rss_kib"].items() if k.startswith(prefix)) / 1024

    row("  storage worker MiB", peak_of("storage"), "{:.0f}")
    row("  dramatiq worker MiB", peak_of("dramatiq"), "{:.0f}")
    row("  ckpt store CLI MiB", lambda r: r["peak_rss_kib"]["ckpt store (CLI)"] / 1024, "{:.0f}")
    row("  ckpt restore CLI MiB", lambda r: r["peak_rss_kib"]["ckpt restore (CLI)"] / 1024, "{:.0f}")
    row("half-changed step: bytes sent vs first", lambda r: r["sent_second_fraction"], "{:.0%}", "<= 55%")
    row("scrub GB/s per worker (unthrottled)", lambda r: r["scrub_gb_per_s_per_worker"])
    width = max(len(n) for n, _, _ in rows) + 2
    head = "metric".ljust(width) + "".join(f"{r['size_gib']:>10} GiB" for r in sizes) + "   target"
    lines = [head, "-" * len(head)]
    lines += [n.ljust(width) + "".join(f"{v:>14}" for v in vals) + (f"   {t}" if t else "") for n, vals, t in rows]
    lines.append("")
    for kind, d in dirs.items():
        lines.append(f"{kind} folder {d['bytes'] / GiB:.2f} GiB: store {d['store_s']:.2f} s, "
                     f"restore {d['restore_s']:.2f} s, identical {d['identical']}")
    if not cp:
        return "\n".join(lines)
    lines.append(f"detection latency (file renamed into place -> detected): p50 {cp['detect_p50_s']:.2f} s, "
                 f"max {cp['detect_max_s']:.2f} s   target p50 <= 0.5 s")
    cps = cp["cp_checkpoints_per_s"]
    lines.append(f"control plane: 200 x 1 MiB checkpoints to verified in {cp['cp_200_seconds']:.1f} s = "
                 f"{cps:.1f} checkpoints/s   target >= 10" if cps
                 else "control plane: 200 checkpoints did not all verify")
    lines.append(f"state transition with 4 processes: p50 {cp['transition_p50_ms']:.1f} ms, "
                 f"p99 {cp['transition_p99_ms']:.1f} ms   target p99 <= 50 ms")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--sizes", default="0.1,1,4", help="checkpoint sizes in GiB (default 0.1,1,4)")
    ap.add_argument("--dirs-gib", type=float, default=0.25, help="size of the HF and DCP folders (GiB)")
    ap.add_argument("--out", help="JSON output (default bench/results/<time>.json)")
    ap.add_argument("--work", help="work directory (default: a temporary one on the same disk as /tmp)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--parts", default="sizes,dirs,control,month,scale,cluster",
                    help="what to run, comma-separated (default sizes,dirs,control,month,scale,cluster)")
    ap.add_argument("--month-saves", type=int, default=1500, help="saves in the month of training (default 1500)")
    ap.add_argument("--cluster-rates", default="100mbit,1gbit",
                    help="link rates of the cluster in a box, comma-separated (default 100mbit,1gbit)")
    ap.add_argument("--cluster-gib", type=float, default=1.0, help="checkpoint size in the box (GiB, default 1)")
    ap.add_argument("--cluster-modes", default="fanout,chain,chain+planes",
                    help="how copies leave the trainer, measured in the box (default fanout,chain,chain+planes; "
                         "chain+zstd is chain+planes with zstd frames, the previous default; chain+s3 adds an "
                         "object store on a shaped link of its own, a required target)")
    ap.add_argument("--throughput-saves", type=int, default=1000,
                    help="saves of the throughput part (default 1000)")
    ap.add_argument("--training-steps", type=int, default=40, help="steps of each training run (default 40)")
    ap.add_argument("--training-save-every", type=int, default=5, help="a save every N steps (default 5)")
    ap.add_argument("--training-profile", default="target,steps",
                    help="target: ~1 GB every 2 minutes; steps: 124 MB every few steps, with priority and "
                         "thread-cap variants (default target,steps)")
    ap.add_argument("--training-only", default="",
                    help="only the training variants of these labels, separated by ; (default: all)")
    ap.add_argument("--training-seconds", type=float, default=330.0,
                    help="training time of each target run (default 330)")
    ap.add_argument("--codec-gib", type=float, default=1.0,
                    help="size of the bf16 checkpoint of --parts codec (GiB, default 1; 0: the 64 MiB of weights only)")
    ap.add_argument("--s3-gib", type=float, default=1.0, help="checkpoint size of the s3 part (GiB, default 1)")
    ap.add_argument("--smoltorrent-dir", metavar="PATH",
                    help="a checkout of github.com/YuvrajSingh-mist/smoltorrent, for --parts smoltorrent (its code is "
                         "not part of this repository: git clone it, then pass its path)")
    ap.add_argument("--replication", choices=("chain", "fanout"),
                    help="replication mode of the loopback systems (default: the system's own, chain)")
    args = ap.parse_args()
    if args.replication:
        System.common["CKPT_REPLICATION"] = args.replication
    work = Path(args.work or tempfile.mkdtemp(prefix="ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        parts = set(args.parts.split(","))
        sizes, dirs, cp, month_doc, scale_doc, boxes, training_docs = [], {}, {}, {}, {}, [], []
        s3_doc: dict = {}
        codec_doc: dict = {}
        throughput_doc: dict = {}
        smol_doc: dict = {}
        for gib in [float(x) for x in args.sizes.split(",")] if "sizes" in parts else []:
            print(f"== {gib} GiB ...", flush=True)
            sizes.append(measure_size(work, gib))
        if "dirs" in parts:
            print("== HF and DCP folders ...", flush=True)
            dirs = measure_dirs(work, args.dirs_gib)
        if "control" in parts:
            print("== control plane ...", flush=True)
            cp = measure_control_plane(work)
        if "month" in parts:
            print(f"== a month of training ({args.month_saves} saves) ...", flush=True)
            month_doc = month.measure_month(work, saves=args.month_saves)
        if "scale" in parts:
            print("== the control plane at 100k checkpoints ...", flush=True)
            scale_doc = scale.measure_scale(work)
        if "cluster" in parts:
            why = cluster.missing()
            if why:
                print(f"== cluster in a box: skipped, it {why}", flush=True)
            for rate in args.cluster_rates.split(",") if not why else []:
                print(f"== cluster in a box at {rate} ...", flush=True)
                boxes.append(cluster.measure_cluster(work, rate, args.cluster_gib,
                                                     tuple(args.cluster_modes.split(","))))
        if "training" in parts:
            for profile in args.training_profile.split(","):
                print(f"== training ({profile}): off, watching, with the callbacks ...", flush=True)
                training_docs.append(training.measure_training(
                    work, profile=profile, steps=args.training_steps, save_every=args.training_save_every,
                    seconds=args.training_seconds,
                    only=tuple(x.strip() for x in args.training_only.split(";") if x.strip())))
        if "throughput" in parts:
            print(f"== throughput: {args.throughput_saves} saves with keep-last rotation ...", flush=True)
            throughput_doc = throughput.measure_throughput(work, saves=args.throughput_saves)
        if "codec" in parts:
            print("== codec: planes, zstd and zipnn side by side ...", flush=True)
            codec_doc = codec.measure_codec(work, args.codec_gib)
        if "s3" in parts:
            print(f"== S3: {args.s3_gib} GiB to SeaweedFS on loopback, ours and boto3's ...", flush=True)
            s3_doc = s3.measure_s3(work / "s3", args.s3_gib)
        if "smoltorrent" in parts:
            why = smoltorrent.missing(args.smoltorrent_dir)
            if why:
                print(f"== smoltorrent: skipped: this part {why}", flush=True)
            else:
                print("== beside smoltorrent: store and restore, 2 runs each, alternating ...", flush=True)
                smol_doc = smoltorrent.measure_smoltorrent(work, Path(args.smoltorrent_dir))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = table(sizes, dirs, cp) if (sizes or dirs or cp) else ""
    out = Path(args.out or Path(__file__).parent / "results" / f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if month_doc:
        text += "\n" + month.table(month_doc)
        chart = month.plot(month_doc, out.parent / "month.png")
        text += f"\n  chart: {chart}"
    if scale_doc:
        text += "\n" + scale.table(scale_doc)
    if throughput_doc:
        text += "\n" + throughput.table(throughput_doc)
    for box in boxes:
        text += "\n" + cluster.table(box)
    for doc in training_docs:
        text += "\n" + training.table(doc)
    if codec_doc:
        text += "\n" + codec.table(codec_doc)
    if s3_doc:
        text += "\n" + s3.table(s3_doc)
    if smol_doc:
        text += "\n" + smoltorrent.table(smol_doc)
    print(text.strip("\n"))
    out.write_text(json.dumps({"sizes": sizes, "dirs": dirs, "control_plane": cp, "month": month_doc,
                               "scale": scale_doc, "cluster": boxes, "training": training_docs, "s3": s3_doc,
                               "codec": codec_doc, "throughput": throughput_doc, "smoltorrent": smol_doc,
                               "table": text},
                              indent=2, default=str))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
