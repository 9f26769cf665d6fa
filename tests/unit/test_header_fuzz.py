"""Hostile safetensors headers: a generated corpus, then hypothesis. The parser must answer
every input with a parsed header or a HeaderError naming the file: never another exception,
never a hang, never an allocation sized by the input."""
from __future__ import annotations

import json
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.header import parse_header
from pipeline.errors import HeaderError

DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "XX", ""]


def blob(header: object, data_len: int, *, length: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + b"\0" * data_len


HUGE = 2**62
CORPUS = {
    "negative begin": blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}}, 1),
    "negative end": blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, -1]}}, 1),
    "huge declared size": blob({"a": {"dtype": "U8", "shape": [HUGE], "data_offsets": [0, HUGE]}}, 8),
    "huge shape product": blob({"a": {"dtype": "F64", "shape": [HUGE, HUGE, HUGE], "data_offsets": [0, 8]}}, 8),
    "offsets past 2**64": blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 2**70]}}, 1),
    "header larger than the file": blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, 1, length=2**40),
    "header length 2**64-1": struct.pack("<Q", 2**64 - 1) + b"{}",
    "offsets as strings": blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": ["0", "1"]}}, 1),
    "shape as a string": blob({"a": {"dtype": "U8", "shape": "1", "data_offsets": [0, 1]}}, 1),
    "boolean offsets": blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, 1),
    "deeply nested JSON": blob(b"[" * 100_000 + b"]" * 100_000, 0),
    "NaN in offsets": blob(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [NaN, 1]}}', 1),
    "metadata with nested object": blob({"__metadata__": {"k": {"x": 1}}}, 0),
    "100k tiny tensors, one overlap": blob({**{f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
                                              for i in range(100_000)},
                                           "z": {"dtype": "U8", "shape": [1], "data_offsets": [5, 6]}}, 100_000),
}


@pytest.mark.parametrize("case", CORPUS)
def test_malformed_header_corpus_is_refused_clearly_and_quickly(case):
    data = CORPUS[case]
    # CPU time of this process, not wall time: the bound catches a parse that grows faster than
    # its input (an overlap check over all pairs), not a machine busy with other tests.
    t = time.process_time()
    with pytest.raises(HeaderError) as info:
        parse_header(data, len(data), "hostile.safetensors")
    assert "hostile.safetensors" in str(info.value)
    assert time.process_time() - t < 5, f"{case} took too long"


def _parse(data: bytes):
    try:
        return parse_header(data, len(data), "fuzz.safetensors")
    except HeaderError as exc:
        assert "fuzz.safetensors" in str(exc)
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_crash_the_parser(data):
    _parse(data)


ints = st.one_of(st.integers(-5, 64), st.integers(-(2**70), 2**70), st.just(HUGE))
entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(DTYPES),
    "shape": st.one_of(st.lists(ints, max_size=4), st.text(max_size=3), st.none()),
    "data_offsets": st.one_of(st.lists(ints, min_size=0, max_size=3), st.none(), st.text(max_size=3)),
})
headers = st.dictionaries(st.text(max_size=8), st.one_of(entry, st.integers(), st.text(max_size=4)), max_size=6)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers, st.integers(0, 256), st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_structured_hostile_headers_are_parsed_or_refused(header, data_len, length):
    data = blob(header, data_len, length=length)
    h = _parse(data)
    if h is not None:  # accepted: then it describes the file exactly
        assert h.data_start + h.data_len == len(data)
        assert sum(t.nbytes for t in h.tensors) == h.data_len
        assert all(t.begin >= 0 and t.end >= t.begin for t in h.tensors)
