"""Reading what each kind of file says about itself: the facts the layout table judges.

Every reader is bounded (sizes checked before reading, nesting and element counts capped) and
never runs code from the file: a torch DCP ``.metadata`` (a pickle) is read by an unpickler
that knows only DCP's metadata classes and builds inert stand-ins for them, never a plain
unpickle. A reader that finds the file unfinished or malformed says why in
``FileFacts.problem``; it raises only ``OSError`` (the file vanished or cannot be read).
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import pickletools
import posixpath
import struct
from typing import Any, BinaryIO

from pipeline.core.header import MAX_HEADER_BYTES, Header, parse_header
from pipeline.core.layouts import FileFacts, FileFormat, rank_metadata
from pipeline.errors import HeaderError

#: JSON files above this size are not parsed (an HF index of a 400B model is a few MB).
MAX_JSON_BYTES = 64 * 1024 * 1024
#: A DCP .metadata above this size is not read.
MAX_DCP_METADATA_BYTES = 256 * 1024 * 1024
ZIP_MAGIC = b"PK\x03\x04"
_EOCD, _ZIP64_LOCATOR, _ZIP64_EOCD, _CENTRAL = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06", b"PK\x01\x02"


def file_facts(relpath: str, abspath: str, size: int, mtime_ns: int) -> tuple[FileFacts, Header | None]:
    """The facts of one file, and its safetensors header when it has a valid one."""
    name = relpath.rsplit("/", 1)[-1] if relpath else os.path.basename(abspath)
    with open(abspath, "rb") as f:
        if name.endswith(".safetensors"):
            try:
                return FileFacts(relpath, size, mtime_ns, FileFormat.SAFETENSORS), read_header_from(f, abspath, size)
            except HeaderError as exc:
                return FileFacts(relpath, size, mtime_ns, FileFormat.SAFETENSORS, problem=exc.reason,
                                 permanent=not exc.truncated), None
        if name.endswith(".distcp"):  # DCP data: items back to back; .metadata says how long each file is
            return FileFacts(relpath, size, mtime_ns, FileFormat.OTHER), None
        if name == ".metadata" or rank_metadata([name]):  # renamed into place whole: any problem is for good
            problem, names, needs, covers = dcp_metadata(f, size)
            return FileFacts(relpath, size, mtime_ns, FileFormat.DCP_METADATA, problem, bool(problem), names,
                             needs, covers=covers), None
        if name.endswith(".json"):
            problem, permanent, names = json_facts(f, size, index=name.endswith(".index.json"))
            return FileFacts(relpath, size, mtime_ns, FileFormat.JSON, problem, permanent, names), None
        magic = f.read(4)
        if magic == ZIP_MAGIC:
            return FileFacts(relpath, size, mtime_ns, FileFormat.TORCH_ZIP, problem=zip_problem(f, size)), None
        if magic[:1] == b"\x80" and size >= 2:
            legacy, problem = torch_legacy(f, size)
            return FileFacts(relpath, size, mtime_ns, FileFormat.TORCH_LEGACY if legacy else FileFormat.PICKLE,
                             problem=problem), None
    return FileFacts(relpath, size, mtime_ns, FileFormat.OTHER), None


# -- safetensors ---------------------------------------------------------------------------

def read_header_from(f: BinaryIO, path: str, size: int) -> Header:
    """Read and validate a safetensors header from the open file ``f`` of ``size`` bytes."""
    f.seek(0)
    first = f.read(8)
    if len(first) < 8:
        raise HeaderError(path, f"file has {size} bytes, fewer than the 8-byte header length", truncated=True)
    (n,) = struct.unpack("<Q", first)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        return parse_header(first, size, path)  # raises with the precise reason
    return parse_header(first + f.read(n), size, path)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at ``path``."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        return read_header_from(f, p, os.fstat(f.fileno()).st_size)


# -- torch.save (zip) ------------------------------------------------------------------------

def zip_problem(f: BinaryIO, size: int) -> str | None:
    """Why a zip (``torch.save``, a Lightning ``.ckpt``) is not complete, or None.

    A zip is written front to back and its end-of-central-directory record last: complete
    means that record is at the very end, and the central directory it points to sits just
    before it (before the zip64 records, for a large file) and starts with a central header.
    """
    if size < 22:
        return f"{size} bytes: too short to hold a zip's end record (still being written)"
    tail_len = min(size, 22 + 0xFFFF)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    pos = len(tail) - 22
    eocd = None
    while pos >= 0:  # the record is followed by its comment, which must reach the end exactly
        pos = tail.rfind(_EOCD, 0, pos + 4)
        if pos < 0:
            break
        if len(tail) >= pos + 22 and pos + 22 + struct.unpack_from("<H", tail, pos + 20)[0] == len(tail):
            eocd = pos
            break
        pos -= 1
    if eocd is None:
        return "no zip end-of-central-directory record at the end (still being written, or truncated)"
    eocd_at = size - tail_len + eocd
    _disk, _cd_disk, _n_here, n_total, cd_size, cd_offset = struct.unpack_from("<HHHHII", tail, eocd + 4)
    end_of_cd = eocd_at
    locator = b""
    if eocd_at >= 20:
        f.seek(eocd_at - 20)
        locator = f.read(20)
    if locator[:4] == _ZIP64_LOCATOR:  # zip64 (torch.save always writes it): its record has the values
        (z64_at,) = struct.unpack_from("<Q", locator, 8)
        if z64_at + 56 > eocd_at - 20:
            return "zip64 locator points past the end record"
        f.seek(z64_at)
        record = f.read(56)
        if record[:4] != _ZIP64_EOCD:
            return "zip64 locator does not point to a zip64 end record"
        n_total, cd_size, cd_offset = struct.unpack_from("<QQQ", record, 32)
        end_of_cd = z64_at
    elif n_total == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        return "zip64 end record without its locator"
    if cd_offset + cd_size != end_of_cd:
        return (f"zip central directory ({cd_size:,} bytes at {cd_offset:,}) does not end where its end record "
                f"starts ({end_of_cd:,}): not a complete zip")
    if n_total:
        f.seek(cd_offset)
        if f.read(4) != _CENTRAL:
            return "zip end record points to no central directory"
    return None


# -- JSON ----------------------------------------------------------------------------------

def json_facts(f: BinaryIO, size: int, *, index: bool) -> tuple[str | None, bool, tuple[str, ...]]:
    """``(problem, permanent, names)`` of a JSON file; an HF index (``*.index.json``) names its files."""
    if size > MAX_JSON_BYTES:
        return None, False, ()  # too large to judge: its folder's layout decides
    f.seek(0)
    raw = f.read(size + 1)
    try:
        doc = json.loads(raw)
    except RecursionError:
        return "JSON nested too deeply", True, ()
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not valid JSON yet ({str(exc)[:80]})", False, ()
    if not index:
        return None, False, ()
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        return "an index without a weight_map object", True, ()
    names = set()
    for value in weight_map.values():
        if not isinstance(value, str) or not safe_relpath(value):
            return f"the index names {str(value)[:80]!r}, which is not a file inside the checkpoint", True, ()
        names.add(posixpath.normpath(value))
    return None, False, tuple(sorted(names))


def safe_relpath(name: str) -> bool:
    """A relative path that stays inside its folder (no absolute path, no ``..``, no NUL)."""
    if not name or "\0" in name or name.startswith("/") or "\\" in name:
        return False
    return ".." not in posixpath.normpath(name).split("/")


# -- torch DCP .metadata: a restricted unpickler ------------------------------------------

#: The globals a DCP .metadata may name (torch 2.x): its metadata classes and the few torch
#: and standard types they hold. Anything else is refused; nothing is imported or called.
DCP_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch", "memory_format"),
    *(("torch", n) for n in (
        "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "uint16", "uint32",
        "uint64", "int8", "int16", "int32", "int64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "quint8", "qint8", "qint32", "strided", "sparse_coo", "contiguous_format",
        "channels_last", "channels_last_3d", "preserve_format")),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
})


class _Inert:
    """A stand-in for an allowed class: keeps its constructor arguments and state, runs nothing."""

    _name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        obj = super().__new__(cls)
        obj.__dict__["args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a frozen/slotted dataclass
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __setitem__(self, key: Any, value: Any) -> None:  # an OrderedDict being filled
        self.__dict__.setdefault("items", {})[key] = value


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, stream: BinaryIO) -> None:
        super().__init__(stream)
        self.classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        if (module, name) not in DCP_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not a torch DCP metadata class")
        key = (module, name)
        if key not in self.classes:
            self.classes[key] = type(name, (_Inert,), {"_name": f"{module}.{name}"})
        return self.classes[key]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def _dims(size: Any) -> tuple[int, ...] | None:
    """The dimensions of an inert ``torch.Size`` stand-in (its constructor argument)."""
    args = getattr(size, "args", None)
    dims = args[0] if isinstance(args, tuple) and len(args) == 1 else None
    if isinstance(dims, tuple) and all(isinstance(d, int) and d >= 0 for d in dims):
        return dims
    return None


def _coverage(md: Any) -> tuple[tuple[str, int, int], ...]:
    """Per tensor a DCP metadata records: (name, elements of the whole tensor, elements its
    chunks hold). A rank of a save without collectives records only its own chunks of a
    sharded tensor: the ranks' files together must cover each tensor whole."""
    meta = getattr(md, "state_dict_metadata", None)
    items = meta if isinstance(meta, dict) else getattr(meta, "items", None)
    if not isinstance(items, dict):
        return ()
    out = []
    for name, info in items.items():
        whole = _dims(getattr(info, "size", None))
        chunks = getattr(info, "chunks", None)
        if whole is None or not isinstance(chunks, list):
            continue  # not a tensor (bytes): written whole by a rank
        held = 0
        for c in chunks:
            dims = _dims(getattr(c, "sizes", None))
            held += math.prod(dims) if dims is not None else 0
        out.append((str(name), math.prod(whole), held))
    return tuple(sorted(out))


DcpFacts = tuple[str | None, tuple[str, ...], tuple[tuple[str, int], ...], tuple[tuple[str, int, int], ...]]


def dcp_metadata(f: BinaryIO, size: int) -> DcpFacts:
    """``(problem, files, needs, covers)`` of a DCP ``.metadata`` (or a rank's): the data files
    it names, per file the bytes it must hold at least (the furthest ``offset + length`` it
    records), and per tensor how much of it its chunks hold (:func:`_coverage`); read once."""
    if size > MAX_DCP_METADATA_BYTES:
        return f".metadata of {size:,} bytes is larger than {MAX_DCP_METADATA_BYTES:,}", (), (), ()
    f.seek(0)
    try:
        md = _DcpUnpickler(io.BytesIO(f.read(size))).load()
    except RecursionError:
        return ".metadata is nested too deeply", (), (), ()
    except Exception as exc:  # any failure to read is a problem of the file, reported as such
        return f".metadata is not torch DCP metadata ({type(exc).__name__}: {str(exc)[:120]})", (), (), ()
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        return ".metadata has no storage_data map", (), (), ()
    needs: dict[str, int] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        if not isinstance(rel, str) or not safe_relpath(rel):
            return f".metadata names {str(rel)[:80]!r}, which is not a file inside the checkpoint", (), (), ()
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            return f".metadata gives {rel} an invalid range", (), (), ()
        rel = posixpath.normpath(rel)
        needs[rel] = max(needs.get(rel, 0), offset + length)
    return None, tuple(sorted(needs)), tuple(sorted(needs.items())), _coverage(md)


# -- torch.save, legacy format ---------------------------------------------------------------

#: The first pickle of a legacy ``torch.save`` (torch.serialization.MAGIC_NUMBER), as each pickle
#: protocol writes it (``torch.save(..., pickle_protocol=P)``).
TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_MAGIC_PICKLES = tuple(pickle.dumps(TORCH_LEGACY_MAGIC, protocol=p) for p in range(2, pickle.HIGHEST_PROTOCOL + 1))
#: Bytes per element of each storage type a legacy ``torch.save`` names (its persistent ids).
_STORAGE_BYTES = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
    "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
    "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16, "QUInt8Storage": 1, "QInt8Storage": 1,
    "QInt32Storage": 4, "QUInt4x2Storage": 1, "QUInt2x4Storage": 1, "UntypedStorage": 1,
}
#: The pickles of a legacy save above this size are not read (its tensors are in the storages
#: after them: ~200 bytes of pickle per tensor), nor above this many memoized values.
MAX_LEGACY_PICKLE_BYTES = 4 * 1024 * 1024
MAX_LEGACY_MEMO = 1_000_000


class _NotJudged(Exception):
    """The file is not read through as a legacy torch.save: the quiet rule decides."""


class _Opaque:
    """A value the walk does not build (a container, an object): only where it stands counts."""


_OPAQUE = _Opaque()
_LITERALS = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "FLOAT", "BINFLOAT"})


class _Bounded:
    """The file, read from where it stands by exactly what is asked (its position is what was
    walked), refusing more than ``limit`` bytes in all."""

    def __init__(self, f: BinaryIO, limit: int) -> None:
        self.f, self.left = f, limit

    def _take(self, n: int) -> int:
        if n > self.left:
            raise _NotJudged("pickles too large to read")
        self.left -= n
        return n

    def read(self, n: int = -1) -> bytes:
        return self.f.read(self._take(n if n >= 0 else self.left))

    def readline(self) -> bytes:
        line = self.f.readline(self.left + 1)
        self._take(len(line))
        return line


def _walk(stream: _Bounded, storages: dict[str, tuple[str, int]], *, lists: bool = False) -> Any:
    """Walk one pickle from ``stream`` without building it (pickletools.genops: nothing imported,
    called or allocated beyond its literals): the persistent ids of storages it names go into
    ``storages`` (key -> (storage type, elements)); its value if a literal, a tuple of them or
    (``lists``) a list of them, else an opaque stand-in. Linear in the pickle's length."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    memoized = 0

    def pop_mark() -> list[Any]:
        if not marks:
            raise _NotJudged("a mark missing")
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def pop() -> Any:
        if len(stack) <= (marks[-1] if marks else 0):
            raise _NotJudged("the stack runs out")
        return stack.pop()

    for op, arg, _pos in pickletools.genops(stream):  # type: ignore[arg-type]  # read, readline suffice
        name = op.name
        if name == "STOP":
            return pop()
        if name in _LITERALS:
            stack.append(arg)
        elif name == "NONE":
            stack.append(None)
        elif name in ("NEWTRUE", "NEWFALSE"):
            stack.append(name == "NEWTRUE")
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            stack.append(("global", module, attr))
        elif name == "STACK_GLOBAL":
            attr, module = pop(), pop()
            stack.append(("global", module, attr) if isinstance(module, str) and isinstance(attr, str) else _OPAQUE)
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "TUPLE":
            stack.append(_shallow(pop_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            stack.append(_shallow([pop() for _ in range(n)][::-1]))
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name == "EMPTY_LIST" and lists:
            stack.append([])
        elif name == "LIST" and lists:
            stack.append(pop_mark())
        elif name == "APPEND" and lists:
            value = pop()
            if not isinstance(stack[-1] if stack else None, list):
                raise _NotJudged("an append to what is not a list")
            stack[-1].append(value)
        elif name == "APPENDS" and lists:
            items = pop_mark()
            if not isinstance(stack[-1] if stack else None, list):
                raise _NotJudged("an append to what is not a list")
            stack[-1].extend(items)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not stack or memoized >= MAX_LEGACY_MEMO:
                raise _NotJudged("too many memoized values")
            key = memoized if name == "MEMOIZE" else arg
            if not isinstance(key, int) or not 0 <= key < MAX_LEGACY_MEMO:
                raise _NotJudged("a memo index out of range")  # PUT's decimal may be any int: colliding hashes
            memoized += 1  # MEMOIZE numbers every value memoized, the opaque ones kept out of ``memo`` too
            if stack[-1] is not _OPAQUE:
                memo[key] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, _OPAQUE) if isinstance(arg, int) else _OPAQUE)
        elif name == "BINPERSID":
            pid = pop()
            if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
                kind, key, numel = pid[1], pid[2], pid[4]
                if not (isinstance(kind, tuple) and len(kind) == 3 and kind[0] == "global" and isinstance(kind[2], str)
                        and isinstance(key, str) and isinstance(numel, int) and numel >= 0):
                    raise _NotJudged("a storage id without its type, key and size")
                storages[key] = (kind[2], numel)
            stack.append(_OPAQUE)
        elif name == "POP":
            if marks and len(stack) == marks[-1]:
                marks.pop()  # POP takes the mark when nothing is above it
            else:
                pop()
        elif name == "DUP":
            stack.append(pop())
            stack.append(stack[-1])
        else:  # any other: what it takes and leaves, by its declared stack effect
            before = op.stack_before
            if pickletools.markobject in before:
                pop_mark()
                for _ in range(before.index(pickletools.markobject)):
                    pop()
            else:
                for _ in before:
                    pop()
            stack.extend(_OPAQUE for x in op.stack_after if x is not pickletools.markobject)
    raise _NotJudged("no STOP")


def _shallow(items: list[Any]) -> Any:
    """A tuple of ``items`` when none is a tuple holding a tuple (a persistent id holds its
    storage type's global, one level down), else an opaque stand-in: nothing the walk keeps is
    nested deeper, so nothing it compares or hashes recurses (a tuple nested 300,000 deep
    overflows the C stack when hashed)."""
    if any(isinstance(i, tuple) and any(isinstance(j, tuple) for j in i) for i in items):
        return _OPAQUE
    return tuple(items)


def torch_legacy(f: BinaryIO, size: int) -> tuple[bool, str | None]:
    """Whether the pickle ``f`` of ``size`` bytes is a legacy ``torch.save`` read through, and
    why it is not complete yet (None: complete).

    The format: four pickles (the magic number, the protocol version, the system's facts, the
    object with a persistent id per storage: its type, key and elements), the storages' keys,
    then each storage in that order as its element count (8 bytes) and its bytes. Complete
    means exactly that long. The pickles are walked, never loaded (:func:`_walk`: linear, and
    nothing in them imported, called or built). A file that cannot be read through that way
    (another pickle, a storage type not known here, pickles above
    :data:`MAX_LEGACY_PICKLE_BYTES`, bytes past the end) is not judged: ``(False, None)``, and the
    quiet rule decides as for any pickle.
    """
    f.seek(0)
    head = f.read(max(len(m) for m in _MAGIC_PICKLES))
    magic = next((m for m in _MAGIC_PICKLES if head.startswith(m)), None)
    cut = "a legacy torch.save cut short in its pickles (still being written)"
    if magic is None:
        cut_in_magic = len(head) == size and any(m.startswith(head) for m in _MAGIC_PICKLES)
        return (True, cut) if cut_in_magic else (False, None)
    f.seek(len(magic))
    stream = _Bounded(f, MAX_LEGACY_PICKLE_BYTES)
    storages: dict[str, tuple[str, int]] = {}
    try:
        for _ in range(3):  # the protocol version, the system's facts, the object
            _walk(stream, storages)
        keys = _walk(stream, {}, lists=True)
    except _NotJudged:
        return False, None
    except (ValueError, EOFError):  # genops: the data ends before the pickle does
        return (True, cut) if f.tell() >= size else (False, None)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys) \
            or set(keys) != set(storages):
        return False, None
    at = f.tell()
    for key in keys:
        kind, numel = storages[key]
        if kind not in _STORAGE_BYTES:
            return False, None
        if at + 8 > size:
            return True, f"a legacy torch.save written up to {size:,} bytes of {at + 8:,} or more (still being written)"
        f.seek(at)
        if struct.unpack("<q", f.read(8))[0] != numel:
            return False, None
        at += 8 + numel * _STORAGE_BYTES[kind]
    if at > size:
        return True, f"a legacy torch.save written up to {size:,} bytes of {at:,} (still being written)"
    return (True, None) if at == size else (False, None)
