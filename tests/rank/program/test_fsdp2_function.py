"""A user function that shards its own model with FSDP2 (``fully_shard`` on ``ctx.mesh["dp"]``), saves it and its
optimizer through ``ctx.checkpoint`` (a distributed checkpoint in ``dcp/``) and, stopped by USR2 on one rank,
resumes to the same weights as an uninterrupted run (real FSDP2 and DCP, 2 ranks on gloo, local executor)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from hpc_train.checkpoint.dcp_state import dcp_model_state
from hpc_train.run.watch import last_logged_step, local_rank_pid
from tests.rank.program.test_runner_local import _wait, attempts, finished, running, start, submit

pytestmark = pytest.mark.slow
STEPS = 12

LOOP = """
import time

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard


def main(ctx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    fully_shard(model[0], mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optimizer, "seen": 0}
    start = ctx.checkpoint.load(state) or 0
    for step in range(start + 1, ctx.params["steps"] + 1):
        generator = torch.Generator().manual_seed(100 * step + ctx.group("dp").rank())
        inputs = torch.randn(8, 16, generator=generator)
        loss = nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state["seen"] += 8
        ctx.log(step, loss=loss.item(), seen=state["seen"])
        time.sleep(ctx.params.get("sleep", 0.0))
        if ctx.should_stop():
            ctx.checkpoint.save(step, state)
            return
    ctx.checkpoint.save(ctx.params["steps"], state)
"""


def _job(folder: Path, sleep: float) -> str:
    (folder / "fsdp_loop.py").write_text(LOOP)
    (folder / "job.toml").write_text(f'[job]\nname = "fsdp"\nprogram = "fsdp_loop.py:main"\ntasks_per_node = 2\n'
                                     f"[params]\nsteps = {STEPS}\nsleep = {sleep}\n")
    return str(folder / "job.toml")


def test_an_fsdp2_model_saved_and_resumed_through_ctx_checkpoint(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    code, output = submit(plain, _job(plain, 0.0))
    assert code == 0, output[-3000:]
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    run_dir = stopped / "runs" / "fsdp"
    with running(start(stopped, _job(stopped, 0.3))) as process:
        _wait(lambda: last_logged_step(run_dir) >= 4 and local_rank_pid(run_dir, 1) is not None, process, "step 4")
        os.kill(local_rank_pid(run_dir, 1), signal.SIGUSR2)
        finished(process)
    runs = attempts(run_dir)
    assert [a["outcome"] for a in runs] == ["preempted", "completed"], runs
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    assert sorted(p.name for p in (final / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    rank0 = torch.load(final / "ranks" / "rank-0.pt", weights_only=True)
    assert sorted(rank0["objects"]) == ["seen"] and rank0["objects"]["seen"] == 8 * STEPS
    expected = dcp_model_state(plain / "runs" / "fsdp" / "checkpoints" / f"step-{STEPS:08d}" / "dcp")
    resumed = dcp_model_state(final / "dcp")
    assert expected.keys() == resumed.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
