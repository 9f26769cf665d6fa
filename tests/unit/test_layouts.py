"""The layout table, checked against the writers installed here and against broken files.

Given the order in which a real library writes a save (recorded by spying on its opens),
When detection judges every prefix of that order (each file complete), Then it calls the
save complete only once every file is there: what each writer writes last is what the table
waits for. Files cut anywhere are never complete by their own structure.
"""
from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.core.layouts import Entry, judge, step_of
from pipeline.detection.completeness import examine
from pipeline.detection.formats import file_facts


class WriteOrder:
    """Records the files opened for writing under a directory, in order (first open wins)."""

    def __init__(self, root: Path) -> None:
        self.root, self.order = str(root), []

    def __enter__(self) -> WriteOrder:
        real = self.real = builtins.open

        def spy(file, mode="r", *a, **k):
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax"):
                path = os.path.abspath(os.fspath(file))
                if path.startswith(self.root) and path not in self.order:
                    self.order.append(path)
            return real(file, mode, *a, **k)

        builtins.open = io.open = spy
        import safetensors.torch

        self.real_save_file = safetensors.torch.save_file

        def save(tensors, filename, metadata=None):  # the Rust writer bypasses open(): route it
            with spy(filename, "wb") as f:
                f.write(safetensors.torch.save(tensors, metadata=metadata))

        safetensors.torch.save_file = save
        self.real_torch_save = torch.save

        def tsave(obj, f, *a, **k):
            if isinstance(f, (str, os.PathLike)):
                with spy(f, "wb") as out:
                    return self.real_torch_save(obj, out, *a, **k)
            return self.real_torch_save(obj, f, *a, **k)

        torch.save = tsave
        return self

    def __exit__(self, *exc: object) -> None:
        import safetensors.torch

        builtins.open = io.open = self.real
        safetensors.torch.save_file = self.real_save_file
        torch.save = self.real_torch_save


def facts_of(folder: Path, paths: list[str]):
    out = []
    for p in paths:
        st = os.stat(p)
        out.append(file_facts(os.path.relpath(p, folder), p, st.st_size, st.st_mtime_ns)[0])
    return tuple(out)


def assert_complete_only_at_the_end(folder: Path, order: list[str]) -> None:
    written = [p for p in order if os.path.isfile(p) and Path(p).parent == folder or folder in Path(p).parents]
    assert written, "the spy saw no file written"
    final = {str(p) for p in folder.rglob("*") if p.is_file()}
    order = [p for p in written if p in final]
    for k in range(1, len(order)):
        v = judge(Entry(folder.name, True, facts_of(folder, order[:k])))
        assert not v.complete, f"complete after only {[Path(p).name for p in order[:k]]}: {v}"
    v = judge(Entry(folder.name, True, facts_of(folder, sorted(final))))
    assert v.complete, v


def tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def test_save_pretrained_sharded_writes_its_index_last(tmp_path):
    out = tmp_path / "step_1"
    with WriteOrder(tmp_path) as spy:
        tiny_qwen().save_pretrained(out, max_shard_size="40KB")
    assert Path(spy.order[-1]).name.endswith(".index.json")
    assert_complete_only_at_the_end(out, spy.order)


def test_a_folder_of_only_config_files_is_not_a_save(tmp_path):
    out = tmp_path / "step_1"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "generation_config.json").write_text("{}")
    v = examine(out).verdict
    assert not v.complete and "no weights yet" in v.reason


def test_hf_trainer_writes_trainer_state_last(tmp_path):
    from transformers import Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.arange(8) + i
            return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, save_steps=2, report_to=[], use_cpu=True,
                             per_device_train_batch_size=4, disable_tqdm=True, logging_steps=100)
    with WriteOrder(tmp_path) as spy:
        Trainer(model=tiny_qwen(), args=args, train_dataset=Data()).train()
    folder = tmp_path / "checkpoint-2"
    mine = [p for p in spy.order if Path(p).parent == folder]
    assert Path(mine[-1]).name == "trainer_state.json"
    assert_complete_only_at_the_end(folder, mine)


def test_accelerate_save_state_writes_its_random_states_last(tmp_path):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    out = tmp_path / "state_1"
    with WriteOrder(tmp_path) as spy:
        acc.save_state(str(out))
    assert Path(spy.order[-1]).name == "random_states_0.pkl", [Path(p).name for p in spy.order]
    assert_complete_only_at_the_end(out, spy.order)


def test_torch_dcp_writes_metadata_last(tmp_path):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp_step_1"
    dcp.save({"w": torch.randn(64, 64), "b": torch.zeros(8)}, checkpoint_id=str(out), no_dist=True)
    files = sorted(str(p) for p in out.iterdir())
    meta = str(out / ".metadata")
    order = [p for p in files if p != meta] + [meta]
    assert_complete_only_at_the_end(out, order)
    (out / "__0_0.distcp").write_bytes((out / "__0_0.distcp").read_bytes()[:-10])  # a rank's file cut short
    v = examine(out).verdict
    assert not v.complete and "__0_0.distcp" in v.reason


def test_dcp_metadata_is_never_unpickled_plainly(tmp_path):
    out = tmp_path / "dcp"
    out.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (out / ".metadata").write_bytes(pickle.dumps({"storage_data": Evil()}))
    v = examine(out).verdict
    assert v.kind == "malformed" and "not torch DCP metadata" in v.reason
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("writer", ["torch.save", "lightning-style", "zip64"])
def test_a_zip_is_complete_only_with_its_end_record(tmp_path, writer):
    p = tmp_path / "step_3.ckpt"
    if writer == "torch.save":
        torch.save({"w": torch.randn(200, 200), "step": 3}, p)
    elif writer == "lightning-style":
        buf = io.BytesIO()
        torch.save({"state_dict": {"w": torch.randn(50)}, "global_step": 3}, buf)
        p.write_bytes(buf.getvalue())
    else:
        with zipfile.ZipFile(p, "w", allowZip64=True) as z:
            with z.open("data", "w", force_zip64=True) as w:
                w.write(os.urandom(50_000))
    data = p.read_bytes()
    assert judge(Entry(p.name, False, (file_facts("", str(p), len(data), 0)[0],))).complete
    for cut in sorted({4, 100, len(data) // 3, len(data) // 2, len(data) - 23, len(data) - 22, len(data) - 1}):
        p.write_bytes(data[:cut])
        facts = file_facts("", str(p), cut, 0)[0]
        assert not judge(Entry(p.name, False, (facts,))).complete, f"complete when cut at {cut} of {len(data)}"


def test_a_safetensors_file_cut_anywhere_is_incomplete_and_a_lying_one_malformed(tmp_path):
    p = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(100), "b": torch.ones(10)}, str(p))
    data = p.read_bytes()
    for cut in (3, 20, len(data) // 2, len(data) - 1):
        p.write_bytes(data[:cut])
        v = judge(Entry(p.name, False, (file_facts("", str(p), cut, 0)[0],)))
        assert v.kind == "incomplete", (cut, v)
    p.write_bytes(data + b"\0" * 8)  # trailing bytes: no writing makes this valid
    assert judge(Entry(p.name, False, (file_facts("", str(p), len(data) + 8, 0)[0],))).kind == "malformed"


def test_a_legacy_torch_save_is_complete_when_as_long_as_its_storages_say(tmp_path):
    p = tmp_path / "step_9.pt"
    state = {"model": {"w": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.bfloat16), "v": torch.arange(9)[2:5]},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(4)}}, "param_groups": [{"lr": 0.1}]},
             "epoch": 3, "args": argparse.Namespace(lr=1e-3), "flags": torch.ones(2, dtype=torch.bool)}
    torch.save(state, p, _use_new_zipfile_serialization=False)
    data = p.read_bytes()
    assert judge(Entry(p.name, False, (file_facts("", str(p), len(data), 0)[0],))).kind == "complete"
    for cut in (2, 8, 40, len(data) // 3, len(data) // 2, len(data) - 1):  # a writer killed anywhere
        p.write_bytes(data[:cut])
        v = judge(Entry(p.name, False, (file_facts("", str(p), cut, 0)[0],)))
        assert v.kind == "incomplete", (cut, v)
    p.write_bytes(data + b"\0" * 8)  # not what torch.save writes: judged by the quiet rule, as before
    assert judge(Entry(p.name, False, (file_facts("", str(p), len(data) + 8, 0)[0],))).kind == "quiet"


class _Runs:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_reading_a_legacy_torch_save_runs_nothing_in_it(tmp_path):
    p, marker = tmp_path / "step_3.pt", tmp_path / "ran"
    torch.save({"w": torch.ones(3), "payload": _Runs(marker)}, p, _use_new_zipfile_serialization=False)
    facts = file_facts("", str(p), p.stat().st_size, 0)[0]
    assert facts.format == "torch-legacy" and facts.problem is None
    assert not marker.exists()


def test_a_pickle_that_is_no_torch_save_or_an_unknown_file_waits_for_quiet(tmp_path):
    p = tmp_path / "step_9.pkl"
    p.write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
    v = judge(Entry(p.name, False, (file_facts("", str(p), p.stat().st_size, 0)[0],)))
    assert v.kind == "quiet"
    q = tmp_path / "weights.npy"
    q.write_bytes(b"\x93NUMPY" + b"\0" * 100)
    assert judge(Entry(q.name, False, (file_facts("", str(q), q.stat().st_size, 0)[0],))).kind == "quiet"


def test_a_commit_marker_decides_for_its_root(tmp_path):
    d = tmp_path / "100"
    d.mkdir()
    save_file({"w": torch.zeros(4)}, str(d / "model.safetensors"))
    assert examine(d, commit_marker="COMMIT").verdict.kind == "incomplete"
    (d / "COMMIT").write_text("")
    assert examine(d, commit_marker="COMMIT").verdict.complete


def test_hf_index_names_outside_the_folder_are_malformed(tmp_path):
    d = tmp_path / "step_2"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "/etc/passwd"}}))
    assert examine(d).verdict.kind == "malformed"


@pytest.mark.parametrize("name,step", [
    ("step_500", 500), ("checkpoint-500", 500), ("global_step500", 500), ("epoch=1-step=500.ckpt", 500),
    ("iter_0000500", 500), ("step500_lr1e-4", 500), ("checkpoint_7", 7), ("500", 500), ("lr1e-4", None),
    ("model-00002-of-00003", None), ("step_" + "1" * 19, None),
])
def test_steps_are_read_by_known_patterns_never_the_last_digits(name, step):
    assert step_of(name) == step


def test_a_declared_checkpoint_skips_the_writers_order_but_not_consistency(tmp_path):
    from pipeline.detection.completeness import accept
    from pipeline.errors import IncompleteCheckpoint

    trainer = tmp_path / "checkpoint-5"
    trainer.mkdir()
    save_file({"w": torch.zeros(4)}, str(trainer / "model.safetensors"))
    assert not examine(trainer).verdict.complete  # no trainer_state.json yet
    assert [e.relpath for e in accept(examine(trainer), declared=True)] == ["model.safetensors"]
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / "__0_0.distcp").write_bytes(b"x" * 10)
    with pytest.raises(IncompleteCheckpoint, match=".metadata"):
        accept(examine(dcp_dir), declared=True)  # nothing could read it back
    broken = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(100)}, str(broken))
    broken.write_bytes(broken.read_bytes()[:-8])
    with pytest.raises(IncompleteCheckpoint, match="truncated"):
        accept(examine(broken), declared=True)
