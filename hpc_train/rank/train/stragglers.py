"""Name the straggler: the rank (and node) whose forward pass is much slower than the others'.

A synchronous job runs at its slowest rank's pace, and every rank's step time shows the same number: the fast
ranks wait inside the gradient collectives. The forward pass has no collective before ZeRO-3 and pipelines, so
its time is the rank's own; on logged steps the ranks all-gather their mean forward time since the last log and
rank 0 names an outlier (a throttled GPU, a busy node, a bad NUMA binding).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.rank.distributed.collectives import all_gather_objects, all_gather_values
from hpc_train.run.node import node_name

__all__ = ["StragglerCheck", "find_straggler", "others_median"]

MIN_GAP_S = 0.010  # below 10 ms a gap is noise on a busy CPU, not a straggler


def find_straggler(times: list[float], factor: float) -> tuple[int, float] | None:
    """(rank, its multiple of the median) when one rank's time exceeds ``factor`` times the median; else None."""
    if factor <= 0 or sum(1 for t in times if t > 0) < 2:
        return None
    rank = max(range(len(times)), key=times.__getitem__)
    slowest = times[rank]
    median = others_median(times, rank)
    if median > 0 and slowest > factor * median and slowest - median > MIN_GAP_S:
        return rank, slowest / median
    return None


def others_median(times: list[float], rank: int) -> float:
    """The median of every other rank's time: with few ranks, the outlier itself would drag a plain median."""
    others = [t for r, t in enumerate(times) if r != rank and t > 0]
    return statistics.median(others) if others else 0.0


class _ForwardTimer:
    def __init__(self, check: StragglerCheck, device: Any) -> None:
        self.check, self.cuda = check, getattr(device, "type", str(device)).startswith("cuda")

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.begun = time.perf_counter()

    def __exit__(self, *_: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.check.events.append((self.start, end))
        else:
            self.check.forward_time(time.perf_counter() - self.begun)


class StragglerCheck:
    """Collects this rank's forward times; :meth:`check` is a collective every rank calls on the same steps."""

    def __init__(self, factor: float, rank: int, log: Callable[[str], None]) -> None:
        self.factor, self.rank, self.log = factor, rank, log
        self.samples: list[float] = []
        self.events: list[tuple[Any, Any]] = []  # CUDA (start, end) pairs not read yet
        self.hosts: list[str] | None = None
        self.previous: int | None = -1  # -1: the first check, whose window holds the warm-up, never names anyone

    def forward_time(self, seconds: float) -> None:
        self.samples.append(seconds)

    def timed(self, device: Any) -> _ForwardTimer:
        """A context around one forward pass. On a GPU it records CUDA events, read at the next check: host
        time would only measure the kernel launches, and a slow GPU would show up later, in ``.item()``."""
        return _ForwardTimer(self, device)

    def check(self, step: int) -> tuple[int, str, float] | None:
        """Gather every rank's mean forward time; rank 0 logs a straggler. Returns (rank, host, ratio) or None."""
        if self.factor <= 0 or not dist.is_initialized():
            return None
        if self.events:
            torch.cuda.synchronize()
            self.samples += [start.elapsed_time(end) / 1000 for start, end in self.events]
            self.events.clear()
        mean = sum(self.samples) / len(self.samples) if self.samples else 0.0
        self.samples.clear()
        if self.hosts is None:
            self.hosts = [str(h) for h in all_gather_objects(node_name())]
        times = [values[0] for values in all_gather_values([mean])]
        found = find_straggler(times, self.factor)
        previous, self.previous = self.previous, (found[0] if found else None)
        if found is None or self.rank != 0 or previous != found[0]:
            return None  # named only when the same rank is the outlier twice running: one slow log is noise
        rank, ratio = found
        host = self.hosts[rank]
        median = others_median(times, rank)
        self.log(f"straggler at step {step}: rank {rank} on {host} takes {times[rank] * 1000:.0f} ms per forward "
                 f"pass, {ratio:.1f}x the median {median * 1000:.0f} ms of the other {len(times) - 1}; check that node "
                 "(nvidia-smi clocks and temperature, other processes, CPU binding)")
        return rank, host, ratio
