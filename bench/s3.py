"""``--parts s3``: a checkpoint to a real S3 server and back, beside boto3's own transfer manager.

A 1 GiB checkpoint (a bf16 decoder in safetensors, bench/layouts.py) goes to SeaweedFS on
loopback (bench/seaweed.py) four ways, each in a fresh child process (its peak RSS from
``wait4``, its seconds timed inside it, imports excluded): our store (``put`` then ``confirm`` by
the store's checksum: pipeline/objectstore), boto3's ``upload_file`` (default TransferConfig,
another key), our restore (``get``: parallel ranged GETs, SHA-256 verified), and boto3's
``download_file`` of its own copy. Same bytes, same server, one run. Targets: store <= 1.1 x
boto3's upload, restore <= 1.1 x boto3's download, peak RSS <= 256 MiB.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import seaweed

GiB = 1024**3
MiB = 1024**2
BUCKET = "ckpt-bench"
ACCESS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_EC2_METADATA_DISABLED": "true"}


def _target(endpoint: str):
    from pipeline.objectstore.config import target_from

    return target_from({"name": "bench", "url": f"s3://{BUCKET}/ckpt", "endpoint": endpoint,
                        "region": "us-east-1"}, "bench")


def _boto3(endpoint: str, **credentials: str):
    """boto3's client as a user makes it (default configuration; credentials from the environment)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials)


def peak_rss_kib() -> int:
    """This process's peak RSS since its exec (VmHWM). ``getrusage``/``wait4`` would report the
    parent's if larger: Linux carries ``maxrss`` over the fork and exec that start a child."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def child(op: str, endpoint: str, path: str, sha: str, size: int) -> dict:
    """One measured operation, in this (fresh) process."""
    if op in ("store", "restore"):
        from pipeline.objectstore.client import ObjectStore

        store = ObjectStore(_target(endpoint))
        t = time.perf_counter()
        if op == "store":
            stored = store.put(sha, Path(path))
            store.confirm(sha, size, stored.checksum)
        else:
            store.get(sha, Path(path), size=size)
        return {"seconds": time.perf_counter() - t, "peak_rss_kib": peak_rss_kib()}
    s3 = _boto3(endpoint)
    t = time.perf_counter()
    if op == "upload_file":
        s3.upload_file(path, BUCKET, f"boto3/{sha}")
    else:
        s3.download_file(BUCKET, f"boto3/{sha}", path)
    return {"seconds": time.perf_counter() - t, "peak_rss_kib": peak_rss_kib()}


def run_child(op: str, endpoint: str, path: Path, sha: str, size: int) -> dict:
    env = {**os.environ, **ACCESS, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "bench.s3", op, endpoint, str(path), sha, str(size)],
                            env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.s3 {op} exited with {proc.returncode}")
    # wait4's maxrss is at least this (torch-sized) parent's RSS: kept for the record only.
    return {**json.loads(out), "wait4_maxrss_kib": usage.ru_maxrss}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 * MiB):
            h.update(block)
    return h.hexdigest()


def measure_s3(work: Path, gib: float = 1.0) -> dict:
    from bench import layouts, limits

    work.mkdir(parents=True, exist_ok=True)
    path = work / "step_1.safetensors"
    layouts.write_file(layouts.decoder(int(gib * GiB), seed=1), path)
    limits.flush(path)
    size, sha = path.stat().st_size, _sha256(path)
    res: dict = {"bytes": size}
    with seaweed.SeaweedFS(work / "seaweed") as server:
        s3 = _boto3(server.endpoint, aws_access_key_id=ACCESS["AWS_ACCESS_KEY_ID"],
                    aws_secret_access_key=ACCESS["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket=BUCKET)
        # Warm-up: the server's volumes grown, its caches and the source file's pages warm for both.
        warm = work / "warm-up"
        warm.write_bytes(os.urandom(64 * MiB))
        s3.upload_file(str(warm), BUCKET, "warm-up")
        s3.download_file(BUCKET, "warm-up", str(warm))
        warm.unlink()
        _sha256(path)
        # boto3 first each time; one run each (the warm-up evens out a cold server).
        res["upload_file"] = run_child("upload_file", server.endpoint, path, sha, size)
        res["store"] = run_child("store", server.endpoint, path, sha, size)
        for op in ("download_file", "restore"):
            dest = work / f"{op}.out"
            res[op] = run_child(op, server.endpoint, dest, sha, size)
            res[op]["identical"] = _sha256(dest) == sha
            dest.unlink()
    path.unlink()
    return res


def table(res: dict) -> str:
    mb = res["bytes"] / 1e6
    rows = [("store: put + confirm (ours)", "store", "upload_file"), ("boto3 upload_file", "upload_file", None),
            ("restore: get + SHA-256 (ours)", "restore", "download_file"),
            ("boto3 download_file", "download_file", None)]
    head = f"{'S3 (SeaweedFS on loopback), ' + format(res['bytes'] / GiB, '.2f') + ' GiB':<34}" \
           f"{'s':>8}{'MB/s':>9}{'ratio':>8}{'peak RSS MiB':>14}   target"
    lines = [head, "-" * len(head)]
    for name, key, versus in rows:
        r = res[key]
        ratio = f"{r['seconds'] / res[versus]['seconds']:.2f}" if versus else ""
        target = "ratio <= 1.1, RSS <= 256" if versus else ""
        lines.append(f"{name:<34}{r['seconds']:>8.2f}{mb / r['seconds']:>9.0f}{ratio:>8}"
                     f"{r['peak_rss_kib'] / 1024:>14.0f}   {target}")
    same = all(res[k]["identical"] for k in ("restore", "download_file"))
    lines.append(f"restored bytes identical: {same}")
    return "\n".join(lines)


if __name__ == "__main__":
    op, endpoint, path, sha, size = sys.argv[1:6]
    print(json.dumps(child(op, endpoint, path, sha, int(size))))
