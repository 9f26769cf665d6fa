"""The bytes each supported writer leaves, in the order it writes them (the layout table of
docs/design.md, section 2), for the model-based lifecycle test.

Every save is built in memory first (real libraries: safetensors, ``torch.save``, torch DCP), so
the test can put its files in place at once (atomically) or one file, or half a file, per step
(a slow writer, or one killed halfway). Tensors are derived from the example's nonce: two
examples never share a content on the storage workers, which keep their data between examples.
"""
from __future__ import annotations

import hashlib
import io
import json
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as st_save

#: Layouts the rules pick from: each is a writer of the layout table.
KINDS = ("st_step", "st_final", "hf_checkpoint", "hf_final", "dcp", "dcp_nocoll", "lightning", "lightning_last")


@dataclass(frozen=True)
class Written:
    """One save as its writer leaves it: the entry's name in the run, whether it is a folder,
    its files in write order (relpath ``""`` for a single file), and the files a re-save in
    place removes first (what the writer itself cleans up)."""

    name: str
    is_dir: bool
    files: tuple[tuple[str, bytes], ...]
    removes: tuple[str, ...] = field(default=())


def _tensors(nonce: int, run_seed: int, step: int, width: int = 48) -> dict[str, torch.Tensor]:
    """A small decoder-like state dict: the embedding and the first layers depend on the run
    only (frozen: shared by every save of the run, so deduplicated), the rest on the step."""
    def rand(tag: str, *shape: int) -> torch.Tensor:
        seed = int.from_bytes(hashlib.sha256(f"{nonce}:{tag}".encode()).digest()[:7], "big")
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    sd = {"embed.weight": rand(f"{run_seed}:embed", 256, width)}
    for i in range(3):
        tag = f"{run_seed}:layer{i}" if i == 0 else f"{run_seed}:{step}:layer{i}"
        sd[f"layers.{i}.attn.weight"] = rand(tag + "a", width, width)
        sd[f"layers.{i}.mlp.weight"] = rand(tag + "m", 2 * width, width)
    sd["lm_head.weight"] = rand(f"{run_seed}:{step}:head", 128, width)
    return sd


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _dcp_files(sd: dict[str, torch.Tensor], *, collectives: bool) -> list[tuple[str, bytes]]:
    """What ``torch.distributed.checkpoint.save`` writes for one process, ``.metadata`` last."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory(prefix="ckpt-model-dcp-") as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=d, no_dist=True, use_collectives=collectives)
        names = sorted(p.name for p in Path(d).iterdir())
        data = [(n, (Path(d) / n).read_bytes()) for n in names if not n.endswith(".metadata")]
        return data + [(n, (Path(d) / n).read_bytes()) for n in names if n.endswith(".metadata")]


def _hf_weights(sd: dict[str, torch.Tensor], sharded: bool) -> list[tuple[str, bytes]]:
    if not sharded:
        return [("model.safetensors", st_save(sd))]
    names, parts, out, weight_map = sorted(sd), 2, [], {}
    for k in range(parts):
        fname = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: sd[n] for n in names[k::parts]}
        out.append((fname, st_save(chunk)))
        weight_map.update({n: fname for n in chunk})
    index = json.dumps({"metadata": {"total_size": sum(t.numel() * 4 for t in sd.values())},
                        "weight_map": weight_map}).encode()
    return out + [("model.safetensors.index.json", index)]


def build(kind: str, nonce: int, run_seed: int, step: int, *, sharded: bool = False) -> Written:
    """The save ``kind`` of training step ``step`` of a run."""
    sd = _tensors(nonce, run_seed, step)
    if kind == "st_step":  # a trainer's own save_file(sd, f"step_{n}.safetensors")
        return Written(f"step_{step}.safetensors", False, (("", st_save(sd)),))
    if kind == "st_final":  # trainer.save_model() into the run: no step in its name
        return Written("model.safetensors", False, (("", st_save(sd)),))
    config = json.dumps({"model_type": "llama", "hidden_size": 48}).encode()
    if kind in ("hf_checkpoint", "hf_final"):
        weights = _hf_weights(sd, sharded)
        # save_pretrained removes the weights files of the other form it finds (not the index).
        stale = ("model.safetensors",) if sharded else ("model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors")
        if kind == "hf_final":
            return Written("final", True, (*weights, ("config.json", config)), stale)
        trainer = (("optimizer.pt", _torch_bytes({"step": step, "lr": 0.1})),
                   ("training_args.bin", _torch_bytes({"output_dir": "out"})),
                   ("trainer_state.json", json.dumps({"global_step": step, "log_history": []}).encode()))
        return Written(f"checkpoint-{step}", True, (*weights, ("config.json", config), *trainer), stale)
    if kind in ("dcp", "dcp_nocoll"):
        return Written(f"step_{step:04d}", True, tuple(_dcp_files(sd, collectives=kind == "dcp")))
    if kind in ("lightning", "lightning_last"):
        blob = _torch_bytes({"epoch": 0, "global_step": step, "state_dict": sd})
        name = "last.ckpt" if kind == "lightning_last" else f"epoch=0-step={step}.ckpt"
        return Written(name, False, (("", blob),))
    raise ValueError(kind)
