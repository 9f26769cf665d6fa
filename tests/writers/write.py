"""Real checkpoint writers, run as a trainer would run them (one process, or gloo ranks).

    python -m tests.writers.write WRITER RUN_DIR

Every model is built from a config (no download). With ``CKPT_SLOW_ROOT`` set, the writes go
through tests.writers.slow (pauses before weights files and inside files). Prints one JSON
line: ``{"saves": [paths...]}``, the checkpoints the writer saved, in order.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import tests.writers.slow  # noqa: F401  (before the libraries that write)


def tiny_qwen(seed: int = 0) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def save_pretrained(run: Path) -> list[str]:
    model = tiny_qwen()
    out = run / "pretrained_step_1"
    model.save_pretrained(out)
    return [str(out)]


def save_pretrained_sharded(run: Path) -> list[str]:
    model = tiny_qwen(1)
    out = run / "sharded_step_1"
    model.save_pretrained(out, max_shard_size="200KB")
    return [str(out)]


def save_pretrained_into_run(run: Path) -> list[str]:
    """``pretrained-2`` (a save_pretrained folder), then the final model saved sharded into the
    run itself, as ``trainer.save_model()`` into the output directory does with a model over
    ``max_shard_size``: its shards and index, each a checkpoint, one save. The saves: the
    folder, the shards, the index (written last)."""
    tiny_qwen(0).save_pretrained(run / "pretrained-2")
    tiny_qwen(1).save_pretrained(run, max_shard_size="200KB")
    shards = sorted(p for p in run.iterdir() if p.name.startswith("model-"))
    return [str(run / "pretrained-2"), *map(str, shards), str(run / "model.safetensors.index.json")]


class Tokens:
    """A tiny causal-LM dataset: fixed random token ids."""

    def __init__(self, n: int = 64, length: int = 16, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 512, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_args(run: Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    args: dict[str, Any] = dict(output_dir=str(run), per_device_train_batch_size=8, max_steps=6, save_steps=2,
                                learning_rate=1e-3, logging_steps=100, report_to=[], use_cpu=True, seed=7,
                                data_seed=7, dataloader_num_workers=0, disable_tqdm=True)
    args.update(overrides)
    return TrainingArguments(**args)


def hf_trainer(run: Path) -> list[str]:
    from transformers import Trainer

    Trainer(model=tiny_qwen(2), args=trainer_args(run), train_dataset=Tokens()).train()
    return [str(run / f"checkpoint-{s}") for s in (2, 4, 6)]


def hf_trainer_final(run: Path) -> list[str]:
    """checkpoint-2/4/6, then what a training script does at its end: ``trainer.save_model()``
    into the run itself (``model.safetensors``: no step in the name)."""
    trainer = _trained(run)
    trainer.save_model()
    return [*(str(run / f"checkpoint-{s}") for s in (2, 4, 6)), str(run / "model.safetensors")]


def hf_trainer_epoch(run: Path) -> list[str]:
    """checkpoint-2/4/6, then the model saved into a folder ``epoch-1`` (no step in the name)."""
    trainer = _trained(run)
    trainer.model.save_pretrained(run / "epoch-1")
    return [*(str(run / f"checkpoint-{s}") for s in (2, 4, 6)), str(run / "epoch-1")]


def _trained(run: Path) -> Any:
    import time

    from transformers import Trainer

    trainer = Trainer(model=tiny_qwen(2), args=trainer_args(run), train_dataset=Tokens())
    trainer.train()
    time.sleep(1.1)  # the final save completes later, on a coarse-clock filesystem too
    return trainer


def lightning_last(run: Path) -> list[str]:
    """``ModelCheckpoint(save_top_k=2, save_last=True)`` on a metric that stops improving after
    step 4: the top-2 files stay at steps 2 and 4 while ``last.ckpt`` is rewritten up to step 10."""
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(32, 32)

        def training_step(self, batch: Any, _i: int) -> Any:
            step = self.global_step + 1
            self.log("score", float(step if step <= 4 else 100 + step))  # best (min) at step 4
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 32)), batch_size=8)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(run), filename="step_{step}", every_n_train_steps=2,
                                               save_top_k=2, save_last=True, monitor="score", mode="min")
    L.Trainer(max_steps=10, callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
              accelerator="cpu", devices=1, default_root_dir=str(run.parent)).fit(Tiny(), data)
    return sorted(str(p) for p in run.glob("*.ckpt"))


def accelerate_state(run: Path) -> list[str]:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    saves = []
    for step in (1, 2):
        loss = model(torch.randn(4, 64)).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        sched.step()
        out = run / f"state_step_{step}"
        accelerator.save_state(str(out))
        saves.append(str(out))
    return saves


def lightning(run: Path) -> list[str]:
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(32, 32)

        def training_step(self, batch: Any, _i: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32)), batch_size=8)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(run), filename="step_{step}", every_n_train_steps=2,
                                               save_top_k=-1)
    L.Trainer(max_steps=6, callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
              accelerator="cpu", devices=1, default_root_dir=str(run.parent)).fit(Tiny(), data)
    return [str(run / f"step_step={s}.ckpt") for s in (2, 4, 6)]


def _dcp_rank(rank: int, world: int, out: str, port: int, collectives: bool = True) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    state = {f"layer{i}.weight": torch.randn(128, 128) for i in range(4)}
    state["step"] = 10
    dcp.save(state, checkpoint_id=out, use_collectives=collectives)
    dist.destroy_process_group()


def dcp(run: Path, world: int, *, collectives: bool = True) -> list[str]:
    """``world`` gloo ranks save one step; without collectives each rank writes its own
    ``__<rank>.metadata`` (torch >= 2.8) instead of the coordinator's ``.metadata``."""
    import torch.multiprocessing as mp

    from pipeline.cluster.client import free_port

    out = run / f"dcp_{world}ranks{'' if collectives else '_local'}_step_10"
    mp.spawn(_dcp_rank, args=(world, str(out), free_port(), collectives), nprocs=world)
    return [str(out)]


def _dtensor_rank(rank: int, world: int, out: str, port: int, seed: int) -> None:
    """One rank of an FSDP2-style save: every tensor a DTensor sharded by rows over the ranks,
    saved without collectives (each rank writes ``__<rank>_0.distcp`` and ``__<rank>.metadata``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    full = {f"layer{i}.weight": torch.randn(128, 64) for i in range(3)}
    dcp.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}, checkpoint_id=out,
             use_collectives=False)
    dist.destroy_process_group()


def sharded_dcp_without_collectives(out: Path, seed: int) -> None:
    """Two gloo ranks save FSDP2-style row-sharded weights into ``out`` without collectives
    (:func:`_dtensor_rank`); the same tensors for the same ``seed``."""
    import torch.multiprocessing as mp

    from pipeline.cluster.client import free_port

    mp.spawn(_dtensor_rank, args=(2, str(out), free_port(), seed), nprocs=2)


def torch_save(run: Path) -> list[str]:
    import torch

    out = run / "step_300.pt"
    torch.save({"model": {f"w{i}": torch.randn(256, 256) for i in range(4)}, "step": 300}, out)
    return [str(out)]


def safetensors_file(run: Path) -> list[str]:
    import torch
    from safetensors.torch import save_file

    out = run / "weights_step_10.safetensors"
    save_file({f"block.{i}.weight": torch.randn(256, 256) for i in range(4)}, str(out))
    return [str(out)]


WRITERS = {
    "save_pretrained": save_pretrained,
    "save_pretrained_sharded": save_pretrained_sharded,
    "save_pretrained_into_run": save_pretrained_into_run,
    "hf_trainer": hf_trainer,
    "hf_trainer_final": hf_trainer_final,
    "hf_trainer_epoch": hf_trainer_epoch,
    "lightning_last": lightning_last,
    "accelerate": accelerate_state,
    "lightning": lightning,
    "dcp2": lambda run: dcp(run, 2),
    "dcp4": lambda run: dcp(run, 4),
    "dcp2_local": lambda run: dcp(run, 2, collectives=False),
    "torch_save": torch_save,
    "safetensors": safetensors_file,
}


def main(argv: list[str]) -> None:
    writer, run = argv[0], Path(argv[1])
    run.mkdir(parents=True, exist_ok=True)
    saves = WRITERS[writer](run)
    print(json.dumps({"saves": saves}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
