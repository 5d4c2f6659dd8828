"""Where a training step's time goes: data wait, forward, backward, optimizer step and exposed communication, per
rank, with the min and max across ranks, averaged over the steps since the previous log line.

Why it can stay on: each phase costs two clock reads (a CPU) or two CUDA events from a reused pool (a GPU) per
micro-batch, and the numbers cross ranks once per logged step, in one all-reduce of eight floats. Megatron's
fine timers and DeepSpeed's ``wall_clock_breakdown`` synchronise the device at every phase; this never does:
CUDA events are read at the log step, when the step's loss is read anyway.

How each phase is measured:

- ``data``: host wall clock around the loader's ``next`` (the time the host waits for a batch; on a GPU the
  device may still be busy with the previous step meanwhile);
- ``forward``, ``backward``, ``optimizer``: on a CPU the wall clock around the model's forward and loss,
  ``engine.backward`` and ``engine.step``; on a GPU the time between CUDA events recorded on the current stream
  before and after each, which is what the device spent on that phase's work (kernels and the collectives
  DeepSpeed launches inside it) without waiting for the host.

- ``comm``: the time the rank waits in collectives that compute did not hide (:mod:`hpc_train.rank.train.comm_clock`):
  on a CPU every step's host time inside gloo collectives; on a GPU one profiled step in ``comm_sample_every``
  logged steps, whose NCCL kernels are laid against the other kernels on the device timeline.

DeepSpeed reduces gradients inside ``backward`` and gathers partitions inside ``step``, so ``comm`` is also part of
those two phases: the shares of the four phases add up to the step, ``comm`` says how much of it was waiting.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.rank.distributed.collectives import all_reduce_values
from hpc_train.rank.train.comm_clock import CollectiveClock, exposed_seconds

__all__ = ["PHASES", "StepBreakdown"]

PHASES = ("data", "forward", "backward", "optimizer")
_REPORTED = (*PHASES, "comm")


class StepBreakdown:
    """Times phases of steps on one rank; :meth:`collect` (collective) turns them into metrics on log steps."""

    def __init__(self, device: torch.device, group: Any = None, clock: CollectiveClock | None = None,
                 sample_every: int = 10) -> None:
        self.cuda = device.type == "cuda"
        self.group = group
        self.clock = None if self.cuda else clock  # a host clock sees only NCCL's launches: GPUs are sampled
        self.sample_every = sample_every
        self._samples = 0
        self._sampled_comm_s: float | None = None  # the latest profiled step's exposed seconds (GPU)
        self._host = dict.fromkeys(PHASES, 0.0)
        self._events: list[tuple[str, Any, Any]] = []
        self._pool: list[tuple[Any, Any]] = []
        self._steps = 0
        self._step_seconds = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the work inside the block as phase ``name`` (one of :data:`PHASES`)."""
        if self.cuda and name != "data":
            start, end = self._pool.pop() if self._pool else (torch.cuda.Event(enable_timing=True),
                                                              torch.cuda.Event(enable_timing=True))
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
            return
        clock = self.clock
        counting = clock is not None and not clock.active
        if counting:
            clock.active = True  # type: ignore[union-attr]
        began = time.perf_counter()
        try:
            yield
        finally:
            self._host[name] += time.perf_counter() - began
            if counting:
                clock.active = False  # type: ignore[union-attr]

    @contextlib.contextmanager
    def sampled(self, logged: bool) -> Iterator[None]:
        """Around one step's micro-batches: on a GPU, every ``sample_every``-th logged step runs under the profiler
        and its exposed communication becomes ``comm`` until the next sample; elsewhere nothing happens."""
        due = self.cuda and logged and self.sample_every > 0 and self._samples % self.sample_every == 0
        if logged:
            self._samples += 1
        if not due:
            yield
            return
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            yield
        comm, compute = [], []
        for event in profiler.events():
            if event.device_type != DeviceType.CUDA:
                continue
            interval = (event.time_range.start / 1e6, event.time_range.end / 1e6)  # microseconds
            (comm if "nccl" in event.name.lower() else compute).append(interval)
        self._sampled_comm_s = exposed_seconds(comm, compute)

    def step_done(self, seconds: float) -> None:
        """One optimizer step ended, ``seconds`` after it began (its wall time, the shares' denominator)."""
        self._steps += 1
        self._step_seconds += seconds

    def collect(self) -> dict[str, float]:
        """Collective (every rank, on the same steps): each phase's mean ms per step on this rank
        (``data_ms``...), its share of the mean step (``data_share``...), and the min and max across ranks
        (``data_ms_min``, ``data_ms_max``...); ``comm_*`` too where measured (CPU ranks always, GPU ranks after their
        first sample: every rank alike); the window starts again."""
        seconds = dict(self._host)
        if self._events:
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                seconds[name] += start.elapsed_time(end) / 1000
                self._pool.append((start, end))
            self._events.clear()
        steps = max(1, self._steps)
        step_ms = 1000 * self._step_seconds / steps
        own = [1000 * seconds[name] / steps for name in PHASES]
        names = PHASES
        if self.clock is not None:
            own, names = [*own, 1000 * self.clock.take() / steps], _REPORTED
        elif self._sampled_comm_s is not None:
            own, names = [*own, 1000 * self._sampled_comm_s], _REPORTED  # one profiled step: already per step
        lowest, highest = own, own
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            both = all_reduce_values([*own, *(-value for value in own)], "max", self.group, torch.float32)
            highest, lowest = both[:len(own)], [-value for value in both[len(own):]]
        self._host = dict.fromkeys(PHASES, 0.0)
        self._steps, self._step_seconds = 0, 0.0
        record: dict[str, float] = {}
        for index, name in enumerate(names):
            record[f"{name}_ms"] = round(own[index], 3)
            record[f"{name}_share"] = round(own[index] / step_ms, 4) if step_ms > 0 else 0.0
            record[f"{name}_ms_min"] = round(float(lowest[index]), 3)
            record[f"{name}_ms_max"] = round(float(highest[index]), 3)
        return record
