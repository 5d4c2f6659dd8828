"""The user code that ``benchmarks/user_code.py`` times: one small DDP loop, in each form it is run.

- under hpc_train, as ``job.program = "benchmarks/user_code_loop.py:FUNCTION"``: :func:`loop` (submit to the
  first step, and preemption on the cluster: ``ctx.log`` and ``ctx.should_stop()`` every step, a save with
  ``ctx.checkpoint.save`` when it says stop) and :func:`overhead` (the same step with and without
  ``ctx.should_stop()`` / ``ctx.log``, and with a bare async all-reduce of a scalar, alternating in blocks,
  timed inside the ranks);
- under plain torchrun, as a script: ``torchrun --nproc_per_node=2 benchmarks/user_code_loop.py EVENTS STEPS HIDDEN``
  (``init_process_group("gloo")`` from the torchrun variables);
- under submitit: ``benchmarks/user_code.py`` wraps :func:`run_submitit` in a ``submitit.helpers.Checkpointable``.

Every form trains the same model on the same batches (an MLP, DDP over gloo, one thread per rank), and rank 0
appends JSON lines ``{"event": ..., "time": ...}`` to an events file: ``enter`` when the user's code starts,
``step`` after each step (hpc_train's own record of a step is its ``metrics.jsonl`` line).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_FEATURES = 16


class Events:
    """Rank 0's JSON lines; other ranks (and a missing path) write nothing."""

    def __init__(self, path: str | None, rank: int) -> None:
        self._file = open(path, "a", buffering=1) if path and rank == 0 else None  # noqa: SIM115 - one per run

    def write(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def build(hidden: int, group: Any = None) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(the model, its DDP wrapper, the optimizer): the same start on every run and every rank."""
    torch.set_num_threads(1)  # two ranks share two cores in every form
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 1))
    net = DistributedDataParallel(model, process_group=group)
    return model, net, torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)


def step_once(net: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, batch: int) -> torch.Tensor:
    """One training step on this rank's batch of ``step`` (the same batch whatever was interrupted)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(batch, IN_FEATURES, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(net(inputs), inputs.sum(dim=1, keepdim=True).sin())
    loss.backward()
    optimizer.step()
    return loss


# --- under hpc_train ----------------------------------------------------------------------------------------

def loop(ctx: Any) -> None:
    """params: steps, hidden, batch, step_sleep (seconds after each step), events (a path, optional)."""
    params = ctx.params
    events = Events(params.get("events"), ctx.rank)
    events.write("enter")
    steps, batch, pause = int(params["steps"]), int(params.get("batch", 32)), float(params.get("step_sleep", 0.0))
    model, net, optimizer = build(int(params.get("hidden", 64)), ctx.group("dp"))
    state = {"model": model, "optimizer": optimizer}
    start = ctx.checkpoint.load(state) or 0
    for step in range(start + 1, steps + 1):
        loss = step_once(net, optimizer, step, ctx.rank, batch)
        ctx.log(step, loss=loss.item())
        if ctx.should_stop():
            ctx.checkpoint.save(step, state)
            return  # hpc_train records the stop and requeues; the next attempt loads this checkpoint
        if pause:
            time.sleep(pause)


def _block(variant: str, ctx: Any, net: nn.Module, optimizer: torch.optim.Optimizer, first: int, count: int,
           batch: int) -> float:
    """``count`` steps of one variant from step ``first``; the seconds they took on this rank."""
    rank = ctx.rank
    dist.barrier()
    started = time.perf_counter()
    if variant == "plain":
        for step in range(first, first + count):
            step_once(net, optimizer, step, rank, batch)
    elif variant == "should_stop":
        for step in range(first, first + count):
            step_once(net, optimizer, step, rank, batch)
            ctx.should_stop()
    elif variant == "async_all_reduce":  # the floor of any collective stop flag: one scalar, read a step late
        pending = None
        for step in range(first, first + count):
            step_once(net, optimizer, step, rank, batch)
            if pending is not None:
                pending[0].wait()
            flag = torch.zeros(1, dtype=torch.int64)
            pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag
        if pending is not None:
            pending[0].wait()
    elif variant == "should_stop+log":
        for step in range(first, first + count):
            loss = step_once(net, optimizer, step, rank, batch)
            ctx.log(step, loss=loss.item())
            ctx.should_stop()
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return time.perf_counter() - started


def overhead(ctx: Any) -> None:
    """params: variants, rounds, block (steps per block), warmup (steps per variant, untimed), hidden, batch,
    out (a path; default: overhead.json in the run folder). Each round runs one block of every variant, the
    order turned by one each round; rank 0 writes every block's seconds (the slower rank's)."""
    params = ctx.params
    variants = list(params["variants"])
    rounds, block, warmup = int(params["rounds"]), int(params["block"]), int(params.get("warmup", 100))
    batch = int(params.get("batch", 32))
    _, net, optimizer = build(int(params.get("hidden", 64)), ctx.group("dp"))
    step = 1
    for variant in variants:
        _block(variant, ctx, net, optimizer, step, warmup, batch)
        step += warmup
    blocks = []
    for index in range(rounds):
        shift = index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            seconds = torch.tensor([_block(variant, ctx, net, optimizer, step, block, batch)], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            blocks.append({"round": index, "variant": variant, "seconds": seconds.item(), "steps": block})
            step += block
    if ctx.rank == 0:
        out = Path(params.get("out") or Path(ctx.run_dir) / "overhead.json")
        out.write_text(json.dumps({"blocks": blocks, "world_size": ctx.world_size}), encoding="utf-8")


# --- under submitit (wrapped in a Checkpointable by benchmarks/user_code.py) --------------------------------

class SubmititRun:
    """The loop as a submitit user writes it: torch.distributed from submitit's JobEnvironment, rank 0 saves its
    own state with torch.save when submitit calls ``checkpoint()`` (in its signal handler, on rank 0 only)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self.attempt = 0

    def run(self) -> int:
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        rank = int(os.environ["RANK"])
        config = self.config
        events = Events(config.get("events"), rank)
        events.write("enter")
        dist.init_process_group("gloo")
        self.model, net, self.optimizer = build(int(config.get("hidden", 64)))
        ckpt = Path(config["folder"]) / "state.pt"
        start = 0
        if ckpt.exists():
            saved = torch.load(ckpt, map_location="cpu", weights_only=True)
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            start, self.attempt = int(saved["step"]), int(saved["attempt"]) + 1
            events.write("resumed", step=start, attempt=self.attempt)
        self.step = start
        batch, pause = int(config.get("batch", 32)), float(config.get("step_sleep", 0.0))
        for step in range(start + 1, int(config["steps"]) + 1):
            loss = step_once(net, self.optimizer, step, rank, batch)
            self.step = step
            events.write("step", step=step, loss=loss.item(), attempt=self.attempt)
            if pause:
                time.sleep(pause)
        del net  # the DDP wrapper holds the group
        leave_group()
        return self.step

    def save(self) -> None:
        """What ``checkpoint()`` does before it resubmits: rank 0's state, written atomically."""
        if self.model is None or self.optimizer is None:
            return
        folder = Path(self.config["folder"])
        temporary = folder / "state.pt.tmp"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "attempt": self.attempt}, temporary)
        os.replace(temporary, folder / "state.pt")
        Events(self.config.get("events"), 0).write("saved", step=self.step, attempt=self.attempt)


def run_submitit(config: dict[str, Any]) -> SubmititRun:
    return SubmititRun(config)


# --- under torchrun ----------------------------------------------------------------------------------------

def torchrun_main(events_path: str, steps: int, hidden: int = 64, batch: int = 32) -> None:
    rank = int(os.environ["RANK"])
    events = Events(events_path, rank)
    events.write("enter")
    dist.init_process_group("gloo")
    _train_steps(events, rank, steps, hidden, batch)
    leave_group()


def _train_steps(events: Events, rank: int, steps: int, hidden: int, batch: int) -> None:
    """The steps in their own frame, so the DDP wrapper (which holds the process group) is gone when it ends."""
    _, net, optimizer = build(hidden)
    for step in range(1, steps + 1):
        loss = step_once(net, optimizer, step, rank, batch)
        events.write("step", step=step, loss=loss.item())


def leave_group() -> None:
    """A barrier, then destroy the group: a rank that leaves while its peer's gloo threads still talk to it can
    end that peer in ``terminate called without an active exception`` (SIGABRT) after its last step."""
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torchrun_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
