"""``--parts codec``: byte-grouped compression side by side with plain zstd and zipnn.

On the same tensors in one run, block by block (4 MiB, as the wire frames them): plain zstd
level 1 on the raw bytes (what the wire does today), the planes codec (pipeline/codec: the
exponent plane through zstd, noise planes raw) with its own zstd parameters and at levels 1
and 3, and zipnn (IBM's byte-grouping compressor, ``pip install zipnn``; said so when it is
missing). Every method runs on the same block one after the other, so the machine's load
falls on all alike; each decoded block is compared with the original. Throughput is raw
bytes per second of the process's CPU time (one thread: per core).

Inputs: 64 MiB of bf16 weights drawn from N(0, 0.02), and the bench's bf16 checkpoint (the
cluster in a box's: bench/layouts.py ``decoder(normal=True)``, written as a safetensors file),
which the planes codec cuts by the segments its header gives and the others take as bytes.
"""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import zstandard

from bench import layouts
from pipeline.codec import frames
from pipeline.codec.segments import Segment, clip, spans
from pipeline.core.header import parse_header

BLOCK = 4 * 1024 * 1024
MiB = 1024 * 1024
#: Targets (issue 31): bf16 ratio, distance to zipnn's ratio, compress speed per core.
RATIO_TARGET, ZIPNN_MARGIN, SPEED_TARGET = 0.69, 0.03, 500e6

Codec = tuple[Callable[[bytes, list[Segment]], bytes], Callable[[bytes], bytes | bytearray]]


def codecs() -> tuple[dict[str, Codec], str | None]:
    """The methods compared, and why zipnn is not among them (``None``: it is)."""
    plain = zstandard.ZstdCompressor(level=1)
    unplain = zstandard.ZstdDecompressor()
    out: dict[str, Codec] = {
        "zstd-1 (raw bytes)": (lambda b, s: plain.compress(b), unplain.decompress),
        "planes": (lambda b, s: frames.encode(b, s), frames.decode),
        "planes zstd-1": (lambda b, s: frames.encode(b, s, level=1), frames.decode),
        "planes zstd-3": (lambda b, s: frames.encode(b, s, level=3), frames.decode),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from zipnn import ZipNN
    except ImportError:
        return out, "zipnn is missing (pip install zipnn -c constraints.txt)"
    zipnn = ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
    # zipnn reorders its input's bytes in place: it is given a copy (made outside the timing).
    out["zipnn"] = (lambda b, s: zipnn.compress(b), zipnn.decompress)
    return out, None


def blocks_of_weights(size: int) -> Iterator[tuple[bytes, list[Segment]]]:
    g = torch.Generator().manual_seed(31)
    for _ in range(size // BLOCK):
        data = (torch.randn(BLOCK // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        yield data, [Segment(0, len(data), "BF16")]


def blocks_of_file(path: Path) -> Iterator[tuple[bytes, list[Segment]]]:
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        header = parse_header(os.pread(f.fileno(), 8 + int.from_bytes(os.pread(f.fileno(), 8, 0), "little"), 0), size)
        typed = spans(header)
        for at in range(0, size, BLOCK):
            data = os.pread(f.fileno(), min(BLOCK, size - at), at)
            yield data, clip(typed, at, len(data))


def measure(blocks: Iterator[tuple[bytes, list[Segment]]], methods: dict[str, Codec]) -> dict[str, dict]:
    res = {name: {"raw": 0, "wire": 0, "compress_s": 0.0, "decompress_s": 0.0, "identical": True}
           for name in methods}
    for data, segs in blocks:
        for name, (compress, decompress) in methods.items():
            given = bytearray(data) if name == "zipnn" else data
            t = time.process_time()
            packed = compress(given, segs)
            t2 = time.process_time()
            back = decompress(packed)
            t3 = time.process_time()
            r = res[name]
            r["raw"] += len(data)
            r["wire"] += len(packed)
            r["compress_s"] += t2 - t
            r["decompress_s"] += t3 - t2
            r["identical"] = r["identical"] and bytes(back) == data
    for r in res.values():
        r["ratio"] = r["wire"] / max(1, r["raw"])
        r["compress_mb_s"] = r["raw"] / 1e6 / max(1e-9, r["compress_s"])
        r["decompress_mb_s"] = r["raw"] / 1e6 / max(1e-9, r["decompress_s"])
    return res


def measure_codec(work: Path, gib: float = 1.0, weights_mib: int = 64) -> dict:
    """The side-by-side table's numbers: per input, per method."""
    methods, missing = codecs()
    doc: dict = {"zipnn_missing": missing, "block": BLOCK, "inputs": {}}
    doc["inputs"][f"{weights_mib} MiB bf16 N(0, 0.02)"] = measure(blocks_of_weights(weights_mib * MiB), methods)
    if gib > 0:
        t = time.perf_counter()
        path = layouts.write_file(layouts.decoder(int(gib * layouts.GiB), seed=1, normal=True),
                                  work / "codec.safetensors")
        doc["generate_s"] = time.perf_counter() - t
        name = f"bench checkpoint {path.stat().st_size / 1e9:.2f} GB bf16"
        try:
            doc["inputs"][name] = measure(blocks_of_file(path), methods)
        finally:
            path.unlink()
    return doc


def table(doc: dict) -> str:
    lines = [f"codec: ratio (bytes out / in) and MB/s of raw bytes per core (CPU time, one thread), "
             f"{doc['block'] // MiB} MiB blocks"]
    if doc["zipnn_missing"]:
        lines.append(f"  ({doc['zipnn_missing']})")
    for name, res in doc["inputs"].items():
        lines.append(f"  {name}")
        lines.append(f"    {'method':<20} {'ratio':>7} {'compress':>9} {'decompress':>11}  identical")
        for method, r in res.items():
            lines.append(f"    {method:<20} {r['ratio']:7.3f} {r['compress_mb_s']:9.0f} {r['decompress_mb_s']:11.0f}"
                         f"  {'yes' if r['identical'] else 'NO'}")
        ours, zipnn = res["planes"], res.get("zipnn")
        verdict = [f"ratio {ours['ratio']:.3f} (target <= {RATIO_TARGET})",
                   f"compress {ours['compress_mb_s']:.0f} MB/s (target >= {SPEED_TARGET / 1e6:.0f})"]
        if zipnn:
            verdict.append(f"{ours['ratio'] / zipnn['ratio'] - 1:+.1%} of zipnn's ratio "
                           f"(target <= +{ZIPNN_MARGIN:.0%})")
        lines.append("    planes: " + ", ".join(verdict))
    return "\n".join(lines)
