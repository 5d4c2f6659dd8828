"""Your own training loop as a function: hpc_train calls ``main(ctx)`` on every rank after the bootstrap.

    python -m hpc_train.submit examples/own_loop/job.toml --site local

The context gives the rank's place and groups, ``ctx.params`` from ``[params]``, checkpoints that survive a
preemption (``ctx.checkpoint``), the preemption signal as one collective answer (``ctx.should_stop()``) and
metrics the login node follows (``ctx.log``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from hpc_train.rank.program.context import RunContext


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: the same on every run, whatever was interrupted."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(size, 16, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def main(ctx: RunContext) -> None:
    steps, lr = int(ctx.params.get("steps", 200)), float(ctx.params.get("lr", 1e-2))
    save_every, pause = int(ctx.params.get("save_every", 50)), float(ctx.params.get("step_sleep", 0.0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)).to(ctx.device)
    net = DistributedDataParallel(model, process_group=ctx.group("dp"))
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    state = {"model": model, "optimizer": optimizer}
    start = ctx.checkpoint.load(state) or 0
    for step in range(start + 1, steps + 1):
        inputs, targets = (t.to(ctx.device) for t in batch(step, ctx.rank))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(inputs), targets)
        loss.backward()
        optimizer.step()
        ctx.log(step, loss=loss.item())
        if pause:
            time.sleep(pause)
        if ctx.should_stop():
            ctx.checkpoint.save(step, state)
            return  # hpc_train records the stop and requeues the job; the next attempt loads this checkpoint
        if step % save_every == 0 or step == steps:
            ctx.checkpoint.save(step, state)
