"""``load_state_dict``: tensors straight from the shards, without writing a file.

Each safetensors shard is fetched (first healthy replica, hash-checked) into one buffer
and its tensors are views of that buffer. A checkpoint without safetensors files but with
one torch pickle (``.pt``/``.bin``/``.pth``) is loaded with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import json
import mmap
import struct
from concurrent.futures import ThreadPoolExecutor

import torch

from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.detection.catalog import resolve
from pipeline.errors import RestoreError
from pipeline.restoring.gather import FileSource, ShardSource, fetch, manifest
from pipeline.settings import Settings

#: Shards fetched at once by load_state_dict.
PARALLEL_SHARDS = 3

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}


def load_state_dict(checkpoint: str | int, settings: Settings | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a protected checkpoint, by name (keys of every safetensors file merged)."""
    settings = settings or settings_mod.current()
    with session_scope(settings.db_url) as s:
        files = manifest(s, resolve(s, checkpoint, settings.host_id))
    key = settings.key()
    tensor_files = [f for f in files if f.format == "safetensors"]
    if tensor_files:
        out: dict[str, torch.Tensor] = {}
        shards = [sh for f in tensor_files for sh in f.shards if sh.kind == "safetensors"]
        # Several shards at once, from different workers: one stream reads a cold replica
        # at about half the disk's speed (1 GiB cold: 1.0-1.3 s one at a time, 0.6-0.7 s
        # three at a time). Each shard has its own buffer, so order does not matter.
        with ThreadPoolExecutor(max_workers=PARALLEL_SHARDS, thread_name_prefix="ckpt-load") as pool:
            for tensors in pool.map(lambda sh: _tensors(_fetch_bytes(sh, key, settings)), shards):
                out.update(tensors)
        return out
    pickles = [f for f in files if f.relpath.endswith((".pt", ".pth", ".bin")) or not f.relpath]
    if len(pickles) == 1:
        data = _file_bytes(pickles[0], key, settings)
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    raise RestoreError(
        "load_state_dict reads safetensors checkpoints or a single torch file; "
        "restore this one with `ckpt restore` and load it with its own library (e.g. torch.distributed.checkpoint)"
    )


def _fetch_bytes(shard: ShardSource, key: bytes, settings: Settings | None = None) -> mmap.mmap:
    # Anonymous memory, not bytearray(size): that zero-fills every page before the shard
    # is received into it (0.5 s per GiB here). The tensors keep it alive. A shard no worker
    # can send comes from an object store (pipeline.restoring.gather), checked the same way.
    buf = mmap.mmap(-1, shard.size)
    fetch(shard, key, (), lambda: None, into=memoryview(buf), wire=settings.wire_compression if settings else "off",
          settings=settings)  # a fallback overwrites it
    return buf


def _file_bytes(f: FileSource, key: bytes, settings: Settings) -> bytes:
    buf = bytearray(f.size)
    for shard in f.shards:
        data = _fetch_bytes(shard, key, settings)
        buf[shard.src_offset : shard.src_offset + shard.length] = data[shard.payload_offset:]
    return bytes(buf)


def _tensors(buf: mmap.mmap) -> dict[str, torch.Tensor]:
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(bytes(buf[8 : 8 + n]))
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        dtype = TORCH_DTYPES.get(info["dtype"])
        if dtype is None:
            raise RestoreError(f"tensor {name!r}: dtype {info['dtype']} has no torch equivalent")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        if end == begin:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=dtype, offset=base + begin, count=(end - begin) // dtype.itemsize)
        out[name] = flat.reshape(shape)
    return out
