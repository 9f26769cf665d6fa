"""Strict safetensors header validation: every way a header can lie is refused, by name."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save, save_file

from pipeline.core.header import MAX_HEADER_BYTES, parse_header, shard_header
from pipeline.detection.completeness import read_header
from pipeline.errors import HeaderError


def raw(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    return struct.pack("<Q", n) + body + data


def t(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_real_file_from_safetensors_library_parses(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.zeros(0)}, str(path),
              metadata={"format": "pt"})
    h = read_header(path)
    assert {x.name for x in h.tensors} == {"a", "b", "c"}
    assert h.metadata == {"format": "pt"}
    assert h.data_start + h.data_len == path.stat().st_size
    assert sum(x.nbytes for x in h.tensors) == h.data_len


BAD = [
    ("shorter than 8 bytes", b"\x01\x02", "fewer than the 8-byte"),
    ("header length beyond the bound", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "exceeds"),
    ("header length past end of file", raw({}, length=1000), "runs past the end"),
    ("not JSON", raw(b"{not json"), "not valid UTF-8 JSON"),
    ("not UTF-8", raw(b'{"\xff": 1}'), "not valid UTF-8 JSON"),
    ("JSON array", raw([1, 2]), "not an object"),
    ("duplicate tensor names", raw(b'{"a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}, '
                                   b'"a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"), "duplicate"),
    ("unknown dtype", raw({"a": t("F7", [1], 0, 1)}, b"x"), "unknown dtype"),
    ("negative dim", raw({"a": t("U8", [-1], 0, 1)}, b"x"), "non-negative"),
    ("float dim", raw({"a": t("U8", [1.5], 0, 1)}, b"x"), "non-negative"),
    ("offsets not a pair", raw({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}, b"x"), "[begin, end]"),
    ("end before begin", raw({"a": t("U8", [0], 5, 4)}, b"x" * 5), "before begin"),
    ("shape disagrees with bytes", raw({"a": t("F32", [2], 0, 4)}, b"x" * 4), "needs 8 bytes"),
    ("gap between tensors", raw({"a": t("U8", [2], 0, 2), "b": t("U8", [2], 3, 5)}, b"x" * 5), "gap"),
    ("overlapping tensors", raw({"a": t("U8", [4], 0, 4), "b": t("U8", [2], 2, 4)}, b"x" * 4), "overlaps"),
    ("first tensor not at 0", raw({"a": t("U8", [2], 2, 4)}, b"x" * 4), "gap"),
    ("truncated data", raw({"a": t("U8", [8], 0, 8)}, b"x" * 5), "truncated"),
    ("trailing bytes", raw({"a": t("U8", [2], 0, 2)}, b"x" * 5), "trailing"),
    ("bad metadata", raw({"__metadata__": {"k": 1}}), "__metadata__"),
    ("entry not an object", raw({"a": [1, 2]}), "not an object"),
]


@pytest.mark.parametrize("case,data,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_header_is_refused_with_a_reason(case, data, needle):
    with pytest.raises(HeaderError) as info:
        parse_header(data, len(data), "bad.safetensors")
    assert needle in str(info.value), f"{case}: {info.value}"
    assert "bad.safetensors" in str(info.value)


def test_truncated_real_file_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(100)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(HeaderError, match="truncated"):
        read_header(path)


def test_shard_header_round_trips_through_the_safetensors_library():
    from safetensors.torch import load

    sd = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3), "y": torch.arange(4, dtype=torch.int64)}
    blob = save(sd)
    h = parse_header(blob, len(blob))
    hdr = shard_header(list(h.tensors))
    assert len(hdr) % 8 == 0
    rebuilt = hdr + blob[h.data_start:]
    out = load(rebuilt)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
