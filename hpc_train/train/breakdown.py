"""Where a training step's time goes: data wait, forward, backward and optimizer step, per rank, with the min and
max across ranks, averaged over the steps since the previous log line.

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

DeepSpeed reduces gradients inside ``backward`` and gathers partitions inside ``step``, so their communication is
part of those two phases here; the exposed share of it alone is not separated yet.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.distributed.collectives import all_reduce_values

__all__ = ["PHASES", "StepBreakdown"]

PHASES = ("data", "forward", "backward", "optimizer")


class StepBreakdown:
    """Times phases of steps on one rank; :meth:`collect` (collective) turns them into metrics on log steps."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.cuda = device.type == "cuda"
        self.group = group
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
        began = time.perf_counter()
        try:
            yield
        finally:
            self._host[name] += time.perf_counter() - began

    def step_done(self, seconds: float) -> None:
        """One optimizer step ended, ``seconds`` after it began (its wall time, the shares' denominator)."""
        self._steps += 1
        self._step_seconds += seconds

    def collect(self) -> dict[str, float]:
        """Collective (every rank, on the same steps): each phase's mean ms per step on this rank
        (``data_ms``...), its share of the mean step (``data_share``...), and the min and max across ranks
        (``data_ms_min``, ``data_ms_max``...); the window starts again."""
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
        lowest, highest = own, own
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            both = all_reduce_values([*own, *(-value for value in own)], "max", self.group, torch.float32)
            highest, lowest = both[:len(own)], [-value for value in both[len(own):]]
        self._host = dict.fromkeys(PHASES, 0.0)
        self._steps, self._step_seconds = 0, 0.0
        record: dict[str, float] = {}
        for index, name in enumerate(PHASES):
            record[f"{name}_ms"] = round(own[index], 3)
            record[f"{name}_share"] = round(own[index] / step_ms, 4) if step_ms > 0 else 0.0
            record[f"{name}_ms_min"] = round(float(lowest[index]), 3)
            record[f"{name}_ms_max"] = round(float(highest[index]), 3)
        return record
