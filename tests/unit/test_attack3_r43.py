"""Round 43, third look from outside (attack3 session), at bcf8d21 (the legacy torch.save reader
walks its pickles) and 9942fa7 (re-save rules). Each test documents a defect that remains and
FAILS at 9ef2978; its docstring gives the sequence and the safe behaviour expected. No pipeline
code changed."""
from __future__ import annotations

import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run_isolated(code: str, *, cpu_seconds: int | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a child interpreter (a crash or a CPU-limit kill is its return code)."""
    pre = ""
    if cpu_seconds is not None:
        pre = f"import resource; resource.setrlimit(resource.RLIMIT_CPU, ({cpu_seconds}, {cpu_seconds}))\n"
    return subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def _facts_in_child(path: Path, *, cpu_seconds: int | None = None) -> subprocess.CompletedProcess:
    """``file_facts`` of ``path`` in a child interpreter; it prints ``VERDICT`` when it returns."""
    return _run_isolated(f"""
        import os
        from pipeline.detection.formats import file_facts
        p = {str(path)!r}
        st = os.stat(p)
        facts, _ = file_facts("", p, st.st_size, st.st_mtime_ns)
        print("VERDICT", facts.format, facts.problem)
    """, cpu_seconds=cpu_seconds)


def _unicode(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def test_the_legacy_reader_survives_a_deeply_nested_storage_type(tmp_path):
    """Sequence: a file in a watched run starts with the legacy magic pickle; its object pickle
    names one storage whose persistent id is ``("storage", (a, b, T), "k", "cpu", 0)`` where T is
    ``((((None,),),),)`` nested 300,000 deep: 300 KB of TUPLE1 opcodes (``\\x85``), well under
    MAX_LEGACY_PICKLE_BYTES. ``_walk`` builds T (tuples of literals are built) and stores
    ``kind[2]`` = T as the storage's type; ``torch_legacy`` then asks ``kind not in
    _STORAGE_BYTES``, which hashes T: tuple hashing recurses in C, one C frame per level, and the
    interpreter dies of a stack overflow (SIGSEGV). ``file_facts`` is called on the watcher's
    thread: the whole watcher process is killed by one file, and again at every restart.

    Safe: whatever the bytes, a verdict (not judged: the quiet rule); a storage type that is not a
    plain string is not a storage type (check ``isinstance(kind[2], str)`` in ``_walk``, or
    don't build nested tuples)."""
    obj = (b"\x80\x02(" + _unicode("storage") + _unicode("a") + _unicode("b") + b"N" + b"\x85" * 300_000
           + b"\x87" + _unicode("k") + _unicode("cpu") + b"K\x00N" + b"tQ.")
    from pipeline.detection.formats import _MAGIC_PICKLES
    hostile = tmp_path / "x.pt"
    hostile.write_bytes(_MAGIC_PICKLES[0] + pickle.dumps(1001, 2) + pickle.dumps({}, 2) + obj
                        + pickle.dumps(["k"], 2) + struct.pack("<q", 0))
    done = _facts_in_child(hostile)
    assert done.returncode == 0 and "VERDICT" in done.stdout, (
        f"file_facts on a 300 KB hostile legacy pickle killed the process: return code {done.returncode}"
        f" ({'SIGSEGV' if done.returncode == -11 else done.stderr[-300:]})")


def test_the_legacy_reader_memo_is_not_keyed_by_colliding_ints(tmp_path):
    """Sequence: ``_walk`` keeps the pickle's memo in a dict keyed by the PUT opcode's argument,
    which is a decimal integer of any size read from the file (``p<digits>\\n``). Keys
    ``k * (2**61 - 1)`` all hash to 0 (Python's int hash is not randomised), so each PUT costs
    O(n) and the walk O(n^2): the same quadratic cost bcf8d21 removed from dict building
    (test_the_legacy_reader_hashes_nothing_the_file_describes), through the memo. Measured: 20,000
    PUTs (0.5 MB) take 2.1 s of CPU, 5,000 take 0.15 s; 3.8 MB (under the 4 MiB cap, 150,000
    PUTs) would take ~2.5 min of the watcher's only scanning thread, at every look.

    Shown without a wall clock: the read runs in a child process under a 20 s CPU-time limit
    (RLIMIT_CPU), several times what the commit's worst case for 4 MiB of hostile opcodes costs
    (2.3 s per 2 MiB); the quadratic memo needs ~2 min. Safe: memo keys bounded (PUT/GET args
    above MAX_LEGACY_MEMO, or beyond the count memoized so far, make the file not judged), so
    the cost stays linear in the file's bytes."""
    from pipeline.detection.formats import _MAGIC_PICKLES
    m = 2**61 - 1
    body = b"\x80\x02N" + b"".join(b"p%d\n" % (k * m) for k in range(1, 150_001)) + b"."
    hostile = tmp_path / "x.pt"
    hostile.write_bytes(_MAGIC_PICKLES[0] + body)
    assert hostile.stat().st_size < 4 * 1024 * 1024
    done = _facts_in_child(hostile, cpu_seconds=20)
    assert done.returncode == 0 and "VERDICT" in done.stdout, (
        f"file_facts on a {hostile.stat().st_size:,}-byte legacy pickle of colliding PUT keys did not finish"
        f" within 20 s of CPU: return code {done.returncode} (-24: SIGXCPU)")


def _lightning_fsdp_sharded_save(path: Path, step: int, *, killed_before_meta: bool = False) -> None:
    """Lightning's own ``FSDPStrategy.save_checkpoint`` (state_dict_type="sharded": what
    ``ModelCheckpoint`` calls for ``last.ckpt`` every epoch), on one process: ``dcp.save`` of the
    weights and optimizer (``__0_0.distcp``, then ``.metadata``), then ``torch.save`` of the rest
    of the checkpoint (epoch, global_step, loops, callbacks) as ``meta.pt``, last."""
    import types

    import torch
    from lightning.pytorch.strategies import fsdp

    strategy = types.SimpleNamespace(broadcast=lambda x: x, _state_dict_type="sharded", global_rank=0)
    checkpoint = {"state_dict": {"w": torch.full((64, 64), float(step))}, "optimizer_states": [],
                  "epoch": step, "global_step": step * 10, "loops": {"fit_loop": {"step": step}}}
    dcp_save = fsdp._distributed_checkpoint_save
    if killed_before_meta:
        def then_killed(*a, **k):
            dcp_save(*a, **k)
            raise KeyboardInterrupt("preempted between .metadata and meta.pt")
        fsdp._distributed_checkpoint_save = then_killed
    try:
        fsdp.FSDPStrategy.save_checkpoint(strategy, checkpoint, path)
    except KeyboardInterrupt:
        pass
    finally:
        fsdp._distributed_checkpoint_save = dcp_save


def test_a_lightning_fsdp_last_ckpt_saved_again_is_not_recorded_with_the_previous_meta_pt(db, tmp_path):
    """Sequence: Lightning with FSDPStrategy(state_dict_type="sharded") and ModelCheckpoint(
    save_last=True) saves ``last.ckpt/`` (a folder) again at every epoch, into the same folder:
    ``dcp.save`` rewrites ``__0_0.distcp`` and ``.metadata``, then rank 0 ``torch.save``s
    ``meta.pt`` (epoch, global_step, loop and callback state; ``FSDPStrategy.load_checkpoint``
    reads it). The torch-dcp layout takes ``.metadata`` for the writer's last file, so between
    the two (or when the job is preempted there) the folder passes ``resave_in_progress``: the new
    weights and the PREVIOUS save's meta.pt are recorded as a complete version, superseding (and
    releasing) the protected save. If the job is preempted there, the recorded newest version of
    last.ckpt is a mix of two saves (epoch-2 weights, epoch-1 loop state) and the protected one
    is garbage after the grace. (When meta.pt does come, the finished save is recorded: checked.)

    Safe: a DCP folder holding Lightning's ``meta.pt`` is complete only once meta.pt is new as
    well (the writer's last file), so the protected version stays current until then, and the
    whole new save is recorded once meta.pt is written."""
    import time

    from pipeline.detection.watcher import Watcher
    from tests.unit.test_attack_i27 import _protect
    from tests.unit.test_attack_r43 import _current

    settings = db
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    last = run / "last.ckpt"
    _lightning_fsdp_sharded_save(last, 1)
    assert {p.name for p in last.iterdir()} >= {".metadata", "__0_0.distcp", "meta.pt"}
    time.sleep(0.05)
    w = Watcher(settings, [].extend, use_events=False)
    for _ in range(3):
        w.scan()
    _protect(settings, last)
    v1 = _current(settings, last).id

    time.sleep(0.05)
    _lightning_fsdp_sharded_save(last, 2, killed_before_meta=True)  # new weights, old meta.pt
    for _ in range(3):
        w.scan()
        time.sleep(0.05)
    now = _current(settings, last)
    assert now.id == v1, (
        f"last.ckpt saved again and stopped before meta.pt was recorded as complete version {now.id} "
        f"(new __0_0.distcp/.metadata beside the previous save's meta.pt), superseding protected {v1}")

    _lightning_fsdp_sharded_save(last, 2)  # the save finished: meta.pt written last
    for _ in range(3):
        w.scan()
        time.sleep(0.05)
    assert _current(settings, last).id not in (v1, now.id), "the finished save of last.ckpt was not recorded"
