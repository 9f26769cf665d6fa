"""What a complete checkpoint looks like, writer by writer: the layout table. Pure.

Every real writer leaves a recognisable trace of having finished. Detection reads the facts
of each file (pipeline.detection.completeness: its format and whether its own structure is
complete) and asks :func:`judge` whether the entry is a checkpoint, complete, or not yet:

==================  ============================================  ===============================
layout              recognised by                                 complete when
==================  ============================================  ===============================
commit-marker       a per-root marker name is configured          the marker file is inside
torch-dcp           ``.metadata`` or ``*.distcp``                 ``.metadata`` names files that
                                                                  are all present, long enough
hf-trainer          a ``checkpoint-N/`` name, ``trainer_state.json``  ``trainer_state.json`` (the
                    or ``training_args.bin``                      Trainer writes it last); in a
                                                                  folder of another name without
                                                                  it, ``training_args.bin``
                                                                  (``save_model`` writes it last)
accelerate          ``random_states_*.pkl``, ``optimizer*.bin``,  ``random_states_0.pkl`` (
                    ``scheduler*.bin``, ``sampler*.bin``          ``save_state`` writes it last)
hf-sharded          ``*.index.json`` or ``*-0000K-of-0000N.*``     the index and every file it
                                                                  names, all N of each group
hf-pretrained       ``config.json``                               a weights file is there (a
                                                                  config alone is not a save)
any other folder    -                                             quiet: no change for the root's
                                                                  quiet period (more files may come)
==================  ============================================  ===============================

and for every file, its own format: a safetensors file is exactly as long as its header says;
a ``torch.save`` zip (``.pt``, ``.bin``, Lightning ``.ckpt``...) ends with a consistent
end-of-central-directory record; a legacy ``torch.save`` (``_use_new_zipfile_serialization=False``)
is exactly as long as its pickles and the storages they name; a ``.json`` file parses. Another
pickle or a file of unknown format has no end marker: it counts as complete only after the
root's quiet period (no change for ``quiet_seconds``), unless the layout's own completion marker
already proves the writer finished. Run-level files that are not checkpoints (DeepSpeed's ``latest``, Megatron's
``latest_checkpointed_iteration.txt``, a run's own ``config.json``, log directories) are never
checkpoints, so never rotated.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from pipeline.core.savegroups import SHARD_NAME


class FileFormat(StrEnum):
    SAFETENSORS = "safetensors"  # header parsed: complete when exactly as long as it says
    TORCH_ZIP = "torch-zip"      # torch.save, Lightning .ckpt: complete with a consistent end record
    TORCH_LEGACY = "torch-legacy"  # legacy torch.save read through: complete when as long as its storages say
    PICKLE = "pickle"            # another pickle (or a legacy torch.save not read through): no end marker
    JSON = "json"                # complete when it parses
    DCP_METADATA = "dcp-metadata"  # torch DCP .metadata: renamed into place whole, read by a restricted unpickler
    OTHER = "other"              # no structure to check


#: Formats whose own structure says when a file is complete.
SELF_CHECKING = frozenset({FileFormat.SAFETENSORS, FileFormat.TORCH_ZIP, FileFormat.TORCH_LEGACY, FileFormat.JSON,
                           FileFormat.DCP_METADATA})


@dataclass(frozen=True)
class FileFacts:
    """One file of an entry, as detection found it."""

    relpath: str        # "" for a single-file checkpoint
    size: int
    mtime_ns: int
    format: str
    #: Why the file is not complete by its own structure (a truncated safetensors file, a zip
    #: without its end record, JSON that does not parse); None when it is, or has no structure.
    problem: str | None = None
    #: The problem is one no further writing can fix (a header that lies, JSON nested too
    #: deep, an index naming a file outside the checkpoint): the entry is malformed.
    permanent: bool = False
    #: For an index (HF) or DCP metadata: the files it names, relative to the entry.
    names: tuple[str, ...] = ()
    #: For DCP metadata: per named file, the bytes it must hold at least.
    needs_bytes: tuple[tuple[str, int], ...] = ()
    #: For DCP metadata: per tensor (name, elements of the whole tensor, elements its chunks hold).
    covers: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class Verdict:
    """What detection should do with an entry."""

    kind: str           # "complete", "incomplete", "quiet" (complete once quiet) or "malformed"
    layout: str         # the layout recognised ("torch-dcp", "hf-trainer", ...; "file" for one file)
    reason: str = ""    # for anything but complete: what is missing, in words

    @property
    def complete(self) -> bool:
        return self.kind == "complete"


@dataclass(frozen=True)
class Entry:
    """An entry directly inside a run: a file or a directory, with every file it holds."""

    name: str
    is_dir: bool
    files: tuple[FileFacts, ...]
    commit_marker: str = ""  # the root's marker file name, if it has one

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.relpath.rsplit("/", 1)[-1] for f in self.files)

    @property
    def relpaths(self) -> frozenset[str]:
        return frozenset(f.relpath for f in self.files)

    def file(self, relpath: str) -> FileFacts | None:
        return next((f for f in self.files if f.relpath == relpath), None)


# -- run-level files ---------------------------------------------------------------------

#: Names in a run that are the run's own files, never a checkpoint (so never rotated).
RUN_FILES = frozenset({
    "latest",                              # DeepSpeed: the tag of the newest checkpoint
    "latest_checkpointed_iteration.txt",   # Megatron-LM
    "latest_checkpoint",
    "config.json", "generation_config.json", "preprocessor_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
    "training_args.bin", "trainer_state.json",
    "all_results.json", "train_results.json", "eval_results.json",
    "README.md", "hparams.yaml", "args.json", "metrics.json",
})
#: Directories in a run that hold logs, not checkpoints.
RUN_DIRS = frozenset({"runs", "logs", "lightning_logs", "wandb", "tensorboard", "mlruns", "tb"})
RUN_GLOBS = ("events.out.tfevents.*", "*.log")


def run_file_reason(name: str, is_dir: bool, is_symlink: bool) -> str | None:
    """Why the entry ``name`` of a run is the run's own file and not a checkpoint, or None."""
    if is_symlink:
        return "a symlink (such as `latest`) is a pointer, not a checkpoint"
    if is_dir and name in RUN_DIRS:
        return "a log directory"
    if not is_dir and (name in RUN_FILES or any(fnmatch.fnmatch(name, g) for g in RUN_GLOBS)):
        return "a run-level file (configuration, tracker or log)"
    return None


# -- steps -------------------------------------------------------------------------------

#: A step number has at most this many digits; a longer run of digits is not a step.
MAX_STEP_DIGITS = 18
_STEP_PATTERNS = tuple(re.compile(p) for p in (
    r"^checkpoint[-_](\d+)(?:$|[^\d])",   # HF Trainer checkpoint-500, accelerate checkpoint_3
    r"(?:^|[^a-z])global_step(\d+)",      # DeepSpeed global_step500
    r"(?:^|[^a-z])iter_(\d+)",            # Megatron iter_0000500
    r"(?:^|[^a-z])step[=_-]?(\d+)",       # step_500, step-500, step500_lr1e-4, epoch=1-step=500.ckpt
    r"^(\d+)(?:$|\.)",                    # Orbax and friends: 500/, 500.pt
))


def step_of(name: str) -> int | None:
    """The training step a checkpoint's name says, by the known patterns; None when none matches
    (retention then orders by detection). Never "the last digits": ``step500_lr1e-4`` is 500."""
    lowered = name.lower()
    for pattern in _STEP_PATTERNS:
        m = pattern.search(lowered)
        if m and len(m.group(1)) <= MAX_STEP_DIGITS:
            return int(m.group(1))
    return None


def nested_run(name: str, subdirs: list[str], run: str) -> str | None:
    """Why an entry of a run is a run itself, or None. An entry holding folders named like
    checkpoints (``checkpoint-500/``, ``global_step500/``, ``iter_0000500/``, ``step_5/``; at
    least two folders of digits alone, such as Orbax's ``100/``) is a run one level down (the
    default root ``checkpoints`` with a Trainer writing to ``checkpoints/hf-run``): recorded
    whole it would be one checkpoint that grows with every save, and rotating it would delete
    the run. It is never recorded; the reason names the fix (a glob root over the runs). An entry
    whose own name has a step is a checkpoint whatever it holds: the Trainer under DeepSpeed saves
    ``checkpoint-500/global_step500/``."""
    if step_of(name) is not None:
        return None
    named = sorted((d for d in subdirs if step_of(d) is not None), key=lambda d: step_of(d) or 0)
    if not named or (all(d.isdigit() for d in named) and len(named) < 2):
        return None
    kind = re.sub(r"\d+", "N", named[0])
    glob = run.rstrip("/") + "/*"
    return (f"{name!r} holds {kind} folders ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''}): it is a "
            f"run, not a checkpoint; watch the runs in {run} with --root {glob!r} "
            "(or that glob in config.toml)")


# -- the layouts -------------------------------------------------------------------------

_WEIGHTS = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.msgpack|\.h5|\.gguf)$")
HF_SIDE_FILES = frozenset({
    "config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "README.md",
})


def _marker(entry: Entry) -> str | None:
    if entry.commit_marker in entry.relpaths:
        return None
    return f"the commit marker {entry.commit_marker!r} is not there yet"


#: A rank's own metadata, written by ``dcp.save(..., use_collectives=False)`` and
#: ``dcp.async_save(..., use_collectives=False)`` (torch >= 2.8): ``__<rank>.metadata`` names that
#: rank's ``__<rank>_<i>.distcp`` files and is renamed into place after them.
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_RANK_DATA = re.compile(r"^__(\d+)_\d+\.distcp$")


def rank_metadata(names: Iterable[str]) -> list[str]:
    """The rank-local DCP metadata files among ``names`` (``__0.metadata``...)."""
    return sorted(n for n in names if _RANK_METADATA.match(n))


def _named_present(meta: FileFacts, sizes: dict[str, int]) -> str | None:
    for name in meta.names:
        if name not in sizes:
            return f"{meta.relpath} names {name}, which is not there"
    for name, needed in meta.needs_bytes:
        if sizes.get(name, 0) < needed:
            return f"{name} has {sizes.get(name, 0):,} of the {needed:,} bytes {meta.relpath} says it holds"
    return None


def _dcp(entry: Entry) -> str | None:
    sizes = {f.relpath: f.size for f in entry.files}
    meta = entry.file(".metadata")
    if meta is None:
        return _dcp_ranks(entry, sizes)
    if meta.problem:
        return f".metadata: {meta.problem}"
    return _named_present(meta, sizes)


def _dcp_ranks(entry: Entry, sizes: dict[str, int]) -> str | None:
    """A save without collectives: no global ``.metadata``; every rank whose data files are
    here has its own ``__<rank>.metadata``, which names files that are all here."""
    metas = [f for f in entry.files if _RANK_METADATA.match(f.relpath)]
    if not metas:
        return ("torch DCP data files (*.distcp) without metadata: neither the .metadata a collective save's"
                " coordinator writes last nor the __<rank>.metadata each rank of a save without collectives"
                " writes last")
    ranks = {int(m[1]) for f in metas if (m := _RANK_METADATA.match(f.relpath))}
    for f in entry.files:
        m = _RANK_DATA.match(f.relpath)
        if m and int(m[1]) not in ranks:
            return f"{f.relpath} is there but not yet __{m[1]}.metadata, which its rank writes last"
    for meta in metas:
        if meta.problem:
            return f"{meta.relpath}: {meta.problem}"
        missing = _named_present(meta, sizes)
        if missing:
            return missing
    # A sharded tensor: each rank records only its own chunks; together they hold it whole (a
    # replicated one is written whole by every rank).
    whole: dict[str, int] = {}
    held: dict[str, int] = {}
    for meta in metas:
        for name, elements, chunk in meta.covers:
            whole[name] = elements
            held[name] = held.get(name, 0) + chunk
    short = sorted(n for n in whole if held[n] < whole[n])
    if short:
        n = short[0]
        return (f"the ranks' metadata here ({', '.join(sorted(m.relpath for m in metas))}) hold {held[n]:,} of the "
                f"{whole[n]:,} elements of {n}{' and more tensors' if len(short) > 1 else ''}: another rank's "
                "__<rank>.metadata and data are not here yet")
    return None


_CHECKPOINT_N = re.compile(r"^checkpoint-\d+$")


def _saved_model(entry: Entry) -> bool:
    """``Trainer.save_model(dir)``'s folder: ``save_pretrained``, then ``training_args.bin``
    last, and never ``trainer_state.json`` (that is ``_save_checkpoint``'s, in ``checkpoint-N/``)."""
    return (_CHECKPOINT_N.match(entry.name) is None and "trainer_state.json" not in entry.relpaths
            and "training_args.bin" in entry.relpaths)


def _trainer(entry: Entry) -> str | None:
    if "trainer_state.json" not in entry.relpaths and not _saved_model(entry):
        return "HF Trainer checkpoint without trainer_state.json (the Trainer writes it last)"
    return None


def _trainer_last(entry: Entry) -> list[str]:
    if "trainer_state.json" in entry.relpaths:
        return ["trainer_state.json"]
    return ["training_args.bin"] if _saved_model(entry) else []


def _weights(entry: Entry) -> list[str]:
    """The weights files of a ``save_pretrained`` folder, which it writes after its config."""
    return sorted(r for r in entry.relpaths if _WEIGHTS.search(r)
                  and r.rsplit("/", 1)[-1] not in HF_SIDE_FILES | {"training_args.bin"})


def _accelerate(entry: Entry) -> str | None:
    if "random_states_0.pkl" not in entry.relpaths:
        return "accelerate save_state folder without random_states_0.pkl (save_state writes it last)"
    return None


def _sharded(entry: Entry) -> str | None:
    groups: dict[tuple[str, str, str, int], set[int]] = {}
    for rel in entry.relpaths:
        m = SHARD_NAME.match(rel.rsplit("/", 1)[-1])
        if m:
            base = rel.rsplit("/", 1)[0] if "/" in rel else ""
            groups.setdefault((base, m["stem"], m["ext"], int(m["n"])), set()).add(int(m["k"]))
    for (base, stem, ext, n), have in sorted(groups.items()):
        missing = sorted(set(range(1, n + 1)) - have)
        if missing:
            where = f"{base}/" if base else ""
            names = ", ".join(f"{where}{stem}-{k:05d}-of-{n:05d}{ext}" for k in missing[:3])
            return f"{len(have)} of {n} shards written; missing {names}{'...' if len(missing) > 3 else ''}"
    indexes = [f for f in entry.files if f.relpath.endswith(".index.json")]
    if groups and not indexes:
        return "every shard is there but not yet the index (*.index.json), which is written last"
    for index in indexes:
        if index.problem:
            return f"{index.relpath}: {index.problem}"
        base = index.relpath.rsplit("/", 1)[0] + "/" if "/" in index.relpath else ""
        absent = sorted(n for n in index.names if base + n not in entry.relpaths)
        if absent and not _stale(index, entry, groups):
            return f"{index.relpath} names missing files: {', '.join(absent[:5])}"
    return None


def _stale(index: FileFacts, entry: Entry, groups: dict[tuple[str, str, str, int], set[int]]) -> bool:
    """An index a re-save left behind: ``save_pretrained`` unsharded into a folder that held a
    sharded save deletes the old shards, writes ``model.safetensors`` and leaves
    ``model.safetensors.index.json`` as it was. Stale when none of the files it names is
    there, no shard of its family is either (a sharded re-save in progress has some), and the
    single file it indexed (its name without ``.index.json``) is complete and newer than it."""
    single = entry.file(index.relpath[: -len(".index.json")])
    if single is None or single.problem or single.mtime_ns < index.mtime_ns:
        return False
    base = index.relpath.rsplit("/", 1)[0] + "/" if "/" in index.relpath else ""
    if any(base + n in entry.relpaths for n in index.names):
        return False
    name = single.relpath.rsplit("/", 1)[-1]
    stem, dot, ext = name.rpartition(".")
    return not any(b == base.rstrip("/") and s == stem and e == dot + ext for b, s, e, _n in groups)


def _index_behind(entry: Entry) -> str | None:
    """A file an index names that is newer than the index: the writer writes the index last,
    so a re-save with the same shard names is rewriting them (old and new shards side by side
    look complete). Complete only once the folder stops changing (a copy that did not keep the
    writer's times waits that long too)."""
    for index in (f for f in entry.files if f.relpath.endswith(".index.json") and not f.problem):
        base = index.relpath.rsplit("/", 1)[0] + "/" if "/" in index.relpath else ""
        for n in index.names:
            f = entry.file(base + n)
            if f is not None and f.mtime_ns > index.mtime_ns:
                return (f"{base + n} is newer than {index.relpath}, which is written last (a re-save rewriting"
                        " the shards): complete once the folder stops changing")
    return None


def _pretrained(entry: Entry) -> str | None:
    if not _weights(entry):
        return "only configuration and tokenizer files so far: no weights yet"
    return None


@dataclass(frozen=True)
class Layout:
    """One row of the layout table."""

    name: str
    writer: str
    recognize: Callable[[Entry], bool]
    #: None when the entry is complete by this layout's rule, else what is missing.
    missing: Callable[[Entry], str | None]
    #: Whether meeting the rule proves the writer finished every file (its last file is
    #: written last), so files without structure need no quiet period.
    proves_finished: bool = True
    #: Whether the rule only reads the writer's order (its last file, a marker): a writer that
    #: declares the checkpoint complete (pipeline.protect) overrides it. A rule about
    #: consistency (the files an index or .metadata names are there) always holds.
    order_only: bool = False
    #: Why an entry complete by the rule may still be mid-save (None: it is not): then it is
    #: complete only once quiet, like a folder of no known layout.
    doubt: Callable[[Entry], str | None] | None = None
    doc: str = field(default="", compare=False)


def _has(*globs: str) -> Callable[[Entry], bool]:
    return lambda e: any(fnmatch.fnmatch(n, g) for n in e.names for g in globs)


LAYOUTS: tuple[Layout, ...] = (
    Layout("commit-marker", "any writer that drops a marker file when done (Orbax style)",
           lambda e: bool(e.commit_marker), _marker, order_only=True),
    Layout("torch-dcp", "torch.distributed.checkpoint (dcp.save, dcp.async_save; with or without collectives)",
           _has(".metadata", "*.distcp", "__*.metadata"), _dcp),
    # By name alone: the Trainer writes config.json and a complete model.safetensors into
    # checkpoint-N/ seconds before training_args.bin, and that alone looks like a save_pretrained.
    Layout("hf-trainer", "transformers Trainer (checkpoint-N/)",
           lambda e: _CHECKPOINT_N.match(e.name) is not None
           or _has("trainer_state.json", "training_args.bin")(e),
           _trainer, order_only=True),
    Layout("accelerate", "accelerate Accelerator.save_state",
           _has("random_states_*.pkl", "optimizer*.bin", "scheduler*.bin", "sampler*.bin"), _accelerate,
           order_only=True),
    Layout("hf-sharded", "transformers save_pretrained(max_shard_size=...) and other sharded writers",
           lambda e: _has("*.index.json")(e) or any(SHARD_NAME.match(n) for n in e.names), _sharded,
           doubt=_index_behind),
    Layout("hf-pretrained", "transformers save_pretrained (one weights file)",
           _has("config.json"), _pretrained, proves_finished=False),
)


def file_problem(f: FileFacts, prefix: str = "") -> str | None:
    return f"{prefix}{f.relpath or 'the file'}: {f.problem}" if f.problem else None


def judge(entry: Entry, *, declared: bool = False) -> Verdict:
    """Whether ``entry`` is a complete checkpoint (:class:`Verdict`).

    ``declared``: the writer said it is complete (pipeline.protect, ``ckpt store``). Then the
    rules that only read the writer's order (its last file, a marker) and the quiet period
    give way; consistency (every file an index or a DCP .metadata names is there) and each
    file's own structure still hold.
    """
    if not entry.files:
        return Verdict("incomplete", "empty", "the directory is empty" if entry.is_dir else "no file")
    bad = next((f for f in entry.files if f.problem and f.permanent), None)
    if bad is not None:
        return Verdict("malformed", "file" if not entry.is_dir else "folder", file_problem(bad) or "")
    if not entry.is_dir:
        (f,) = entry.files
        if f.problem:
            return Verdict("incomplete", "file", f.problem)
        if f.format in SELF_CHECKING or declared:
            return Verdict("complete", "file")
        return Verdict("quiet", "file", f"a {f.format} file has no end marker: complete once it stops changing")
    # Every layout the entry shows must be complete: an HF Trainer folder also holds a sharded
    # model, whose index and shards must all be there too. The first one names the layout.
    shown = [lay for lay in LAYOUTS if lay.recognize(entry)]
    name = shown[0].name if shown else "folder"
    for lay in shown:
        missing = None if (declared and lay.order_only) else lay.missing(entry)
        if missing:
            return Verdict("incomplete", name, missing)
    broken = next((p for f in entry.files if (p := file_problem(f))), None)
    if broken:
        return Verdict("incomplete", name, broken)
    if declared:
        return Verdict("complete", name)
    if not shown:
        # No writer's trace: more files may still come (accelerate writes model.safetensors,
        # then pauses before optimizer.bin). Only a quiet folder is taken as finished.
        return Verdict("quiet", "folder", "no known layout: complete once the folder stops changing")
    doubt = next((d for lay in shown if lay.doubt is not None and (d := lay.doubt(entry))), None)
    if doubt:
        return Verdict("quiet", name, doubt)
    unchecked = [f.relpath for f in entry.files if f.format not in SELF_CHECKING]
    if unchecked and not any(lay.proves_finished for lay in shown):
        listed = ", ".join(unchecked[:3]) + ("..." if len(unchecked) > 3 else "")
        return Verdict("quiet", name, f"{listed} {'have' if len(unchecked) > 1 else 'has'} no end marker: "
                                      "complete once the folder stops changing")
    return Verdict("complete", name)


def describe() -> Sequence[tuple[str, str]]:
    """(layout, writer) for every row of the table, for documentation and ``ckpt status``."""
    return [(lay.name, lay.writer) for lay in LAYOUTS]


# -- saved again over a recorded version ----------------------------------------------------

def _dcp_last(entry: Entry) -> list[str]:
    """A DCP folder's last files: its ``.metadata`` (each rank's, without collectives), or
    Lightning's ``meta.pt`` (FSDP and ModelParallel strategies: the rest of the trainer's state,
    ``torch.save``d by rank 0 after ``dcp.save`` returned)."""
    if "meta.pt" in entry.relpaths and ".metadata" in entry.relpaths:
        return ["meta.pt"]
    return sorted(r for r in entry.relpaths if r.rsplit("/", 1)[-1].endswith(".metadata"))


def _complete_indexes(entry: Entry) -> list[str]:
    """The HF indexes whose named files are all there: an index naming files that are gone is
    one a writer left behind (save_pretrained unsharded over a sharded save), not its last file."""
    out = []
    for f in entry.files:
        if f.relpath.endswith(".index.json") and not f.problem:
            base = f.relpath.rsplit("/", 1)[0] + "/" if "/" in f.relpath else ""
            if all(base + n in entry.relpaths for n in f.names):
                out.append(f.relpath)
    return out


#: Per layout, the files its writer writes last (the table above). Over a recorded version at
#: the same path, a save is complete only once one of them is new as well.
_LAST_WRITTEN: dict[str, Callable[[Entry], list[str]]] = {
    "commit-marker": lambda e: [e.commit_marker] if e.commit_marker in e.relpaths else [],
    "torch-dcp": lambda e: _dcp_last(e),
    "hf-trainer": _trainer_last,
    "accelerate": lambda e: ["random_states_0.pkl"] if "random_states_0.pkl" in e.relpaths else [],
    "hf-sharded": _complete_indexes,
}


def _config_before_weights(entry: Entry, changed: list[str], now: Mapping[str, tuple[int, int]],
                           recorded: Mapping[str, tuple[int, int]]) -> str | None:
    """``save_pretrained`` writes ``config.json``, then the weights beside it (each component of a
    pipeline in a folder of its own): a folder whose recorded config was written again while none
    of its weights was is a save killed between them, why so; else None."""
    for cfg in changed:
        if cfg.rsplit("/", 1)[-1] != "config.json" or cfg not in now or cfg not in recorded:
            continue
        base = cfg[: -len("config.json")]
        weights = [r for r in _weights(entry) if r.startswith(base) and "/" not in r[len(base):]]
        if weights and all(now[r] == recorded.get(r) for r in weights):
            return (f"saved again over its recorded version ({cfg} changed) but not yet {', '.join(weights[:3])}, "
                    "which save_pretrained writes after it")
    return None


def resave_in_progress(entry: Entry, recorded: Mapping[str, tuple[int, int]], *, by_quiet: bool = False
                       ) -> str | None:
    """Why ``entry``, a folder whose recorded version had the files ``recorded`` (relative
    path -> size, modification time), is a new save still being written over it, or None.

    A writer saving again into the same folder leaves the old version's last file (its
    ``.metadata``, ``trainer_state.json``, marker, index) in place until it writes its own: the
    folder then looks complete while it mixes two saves. So once any file differs from the
    recorded version, every layout the folder shows must have a last file that differs too.
    ``by_quiet``: the folder would be complete only because it stopped changing (no layout
    knows its last file): then a folder keeping some recorded files unchanged while others
    changed is taken for a save killed between two files (a mix of two saves), never for a
    new version; ``ckpt store PATH`` records it as it is if it is one.
    """
    if not entry.is_dir or not recorded:
        return None
    now = {f.relpath: (f.size, f.mtime_ns) for f in entry.files}
    changed = sorted(r for r in now.keys() | recorded.keys() if now.get(r) != recorded.get(r))
    if not changed:
        return None
    # Files only added beside an intact recorded version (the rest of a save recorded early, a
    # tokenizer saved after the model) are that save growing, not a new one over it.
    rewritten = any(r in recorded for r in changed)
    for lay in LAYOUTS if rewritten else ():
        last = _LAST_WRITTEN.get(lay.name, lambda e: [])(entry) if lay.recognize(entry) else []
        # A save without collectives: each rank writes its own last file, and every rank must
        # have saved again; otherwise any new last file will do.
        every = lay.name == "torch-dcp" and ".metadata" not in entry.relpaths
        if last and (any if every else all)(now[r] == recorded.get(r) for r in last):
            listed = ", ".join(changed[:3]) + ("..." if len(changed) > 3 else "")
            return (f"saved again over its recorded version ({listed} changed) but not yet "
                    f"{' or '.join(last)}, which its writer ({lay.writer}) writes last")
    if rewritten and (why := _config_before_weights(entry, changed, now, recorded)):
        return why
    kept = sorted(r for r in recorded if now.get(r) == recorded[r])
    gone = sorted(r for r in recorded if r not in now)
    if by_quiet and (kept or gone):
        listed = ", ".join(changed[:3]) + ("..." if len(changed) > 3 else "")
        what = f"{', '.join(kept[:3])} did not" if kept else f"{', '.join(gone[:3])} is gone"
        return (f"saved again over its recorded version: {listed} changed but {what} "
                "(a save stopped between two files?); `ckpt store PATH` records it as it is")
    return None
