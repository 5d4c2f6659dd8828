"""A user function that builds its own DeepSpeed engine (ZeRO-2) on the context's groups, saves it through
``ctx.checkpoint`` and, stopped by USR2 on one rank, resumes to the same weights and optimizer state as an
uninterrupted run (real DeepSpeed, 2 ranks on gloo, local executor)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from hpc_train.run.watch import last_logged_step, local_rank_pid
from tests.rank.program.test_runner_local import _wait, attempts, finished, running, start, submit

pytestmark = pytest.mark.slow
STEPS = 12

LOOP = """
import time

import deepspeed
import torch
from torch import nn

from hpc_train.rank.train.dscomm import init_deepspeed_comm


def main(ctx):
    init_deepspeed_comm(ctx.local_rank)  # DeepSpeed's comm layer on the group ctx started
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    state = {"engine": engine, "seen": 0}
    start = ctx.checkpoint.load(state) or 0
    for step in range(start + 1, ctx.params["steps"] + 1):
        generator = torch.Generator().manual_seed(100 * step + ctx.group("dp").rank())
        inputs = torch.randn(8, 16, generator=generator)
        loss = nn.functional.mse_loss(engine(inputs), inputs.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        state["seen"] += 8
        ctx.log(step, loss=loss.item(), seen=state["seen"])
        time.sleep(ctx.params.get("sleep", 0.0))
        if ctx.should_stop():
            ctx.checkpoint.save(step, state)
            return
    ctx.checkpoint.save(ctx.params["steps"], state)
"""


def _job(folder: Path, sleep: float) -> str:
    (folder / "ds_loop.py").write_text(LOOP)
    (folder / "job.toml").write_text(f'[job]\nname = "ds"\nprogram = "ds_loop.py:main"\ntasks_per_node = 2\n'
                                     f"[params]\nsteps = {STEPS}\nsleep = {sleep}\n")
    return str(folder / "job.toml")


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    folder = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "deepspeed" / "engine" / "state"
    tensors = dict(torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)["module"])
    for shard in sorted(folder.glob("*optim_states.pt")):
        optim = torch.load(shard, weights_only=False)["optimizer_state_dict"]
        for index, flat in enumerate(optim["single_partition_of_fp32_groups"]):
            tensors[f"{shard.name}.fp32.{index}"] = flat
    return tensors


def test_a_deepspeed_engine_saved_and_resumed_through_ctx_checkpoint(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    code, output = submit(plain, _job(plain, 0.0))
    assert code == 0, output[-3000:]
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    run_dir = stopped / "runs" / "ds"
    with running(start(stopped, _job(stopped, 0.3))) as process:
        _wait(lambda: last_logged_step(run_dir) >= 4 and local_rank_pid(run_dir, 1) is not None, process, "step 4")
        os.kill(local_rank_pid(run_dir, 1), signal.SIGUSR2)
        finished(process)
    runs = attempts(run_dir)
    assert [a["outcome"] for a in runs] == ["preempted", "completed"], runs
    assert runs[1]["start_step"] == runs[0]["end_step"]
    rank0 = torch.load(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "ranks" / "rank-0.pt", weights_only=True)
    assert rank0["objects"]["seen"] == 8 * STEPS  # a plain value comes back too
    expected, resumed = _final(plain / "runs" / "ds"), _final(run_dir)
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
