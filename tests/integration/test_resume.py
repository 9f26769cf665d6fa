"""Train, protect, lose the local copy, restore, resume: identical to never stopping."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.restoring.loader import load_state_dict
from tests.integration.conftest import checkpoint_job

pytestmark = pytest.mark.integration


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def train(model, opt, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_resume_from_restored_checkpoint_matches_uninterrupted_run(make_cluster, tmp_path):
    cluster = make_cluster()
    reference, ref_opt = model_and_opt()
    train(reference, ref_opt, range(10))

    model, opt = model_and_opt()
    train(model, opt, range(5))
    run = cluster.runs / "run-resume"
    run.mkdir()
    staging = run / ".step_5.tmp"
    staging.mkdir()
    save_file(model.state_dict(), str(staging / "model.safetensors"))
    torch.save(opt.state_dict(), staging / "optimizer.pt")
    staging.rename(run / "step_5")

    job_id = checkpoint_job(cluster, run / "step_5")
    cluster.wait_job(job_id, ("verified",))
    shutil.rmtree(run / "step_5")  # the local disk is gone
    del model, opt

    dest = tmp_path / "restored"
    r = cluster.cli("restore", str(run / "step_5"), "--to", str(dest), "--wait")
    assert r.returncode == 0, r.stderr
    model, opt = model_and_opt()
    model.load_state_dict(load_file(str(dest / "model.safetensors")))
    opt.load_state_dict(torch.load(dest / "optimizer.pt", weights_only=True))
    # The in-memory path gives the same weights without writing a file.
    direct = load_state_dict(str(run / "step_5"), cluster.settings)
    assert all(torch.equal(direct[k], v) for k, v in model.state_dict().items())

    train(model, opt, range(5, 10))
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
