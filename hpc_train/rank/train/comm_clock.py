"""Exposed communication: the time a rank waits in collectives that compute did not hide.

Two measurements, because the host and the device see collectives differently:

- **Host clock** (gloo, CPU ranks): the wall time inside ``torch.distributed``'s collectives while a step's phases
  run, and inside ``wait()`` on their handles. A CPU rank computes nothing while gloo runs a blocking collective,
  so that time is exposed by definition; the cost is two clock reads per collective. It is installed on
  ``torch.distributed`` (and ``distributed_c10d``) before DeepSpeed starts, since DeepSpeed keeps references to
  the gather and reduce-scatter functions it picks at start. Nested calls (``all_gather_object`` calls
  ``all_gather``) count once.
- **Device timeline** (NCCL, GPU ranks): a host clock would see only kernel launches, so one step in
  ``[monitor] comm_sample_every`` logged steps runs under ``torch.profiler`` with CUDA activity, and the exposed
  time is the part of the NCCL kernels' intervals that no other kernel overlaps (:func:`exposed_seconds`). The
  other logged steps report the latest sample.

``HPC_TRAIN_INJECT_FAULT=slow_comm:R:MS`` makes rank R spend MS more milliseconds in each collective of a step
(a slow fabric, for the tests): its peers then wait in the same collective.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["COLLECTIVES", "CollectiveClock", "exposed_seconds"]

COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "_reduce_scatter_base", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "all_gather_object", "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single",
               "gather", "scatter", "barrier", "send", "recv",
               "all_gather_single", "reduce_scatter_single")  # FSDP2's own (torch >= 2.10)

_NAMESPACES = (dist, distributed_c10d)


class _TimedWork:
    """An async collective's handle whose ``wait()`` counts as exposed time; everything else is the handle's."""

    def __init__(self, work: Any, clock: CollectiveClock) -> None:
        self._work, self._clock = work, clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.seconds += time.perf_counter() - began

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveClock:
    """Counts host seconds in collectives while :attr:`active` (set by the breakdown's phases on the main thread)."""

    _installed: CollectiveClock | None = None

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.active = False
        self.seconds = 0.0
        self._depth = 0
        self._main = threading.get_ident()
        self._originals: list[tuple[Any, str, Callable[..., Any]]] = []

    @classmethod
    def install(cls, delay_s: float = 0.0) -> CollectiveClock:
        """The process's clock, wrapping the collectives once (a second call returns the first clock)."""
        if cls._installed is not None:
            cls._installed.delay_s = delay_s
            return cls._installed
        clock = cls(delay_s)
        wrapped: dict[int, Callable[..., Any]] = {}
        for namespace in _NAMESPACES:
            for name in COLLECTIVES:
                original = getattr(namespace, name, None)
                if original is None:
                    continue
                if id(original) not in wrapped:
                    wrapped[id(original)] = clock._wrap(original)
                clock._originals.append((namespace, name, original))
                setattr(namespace, name, wrapped[id(original)])
        cls._installed = clock
        return clock

    def uninstall(self) -> None:
        """Put the original collectives back (tests)."""
        for namespace, name, original in self._originals:
            setattr(namespace, name, original)
        self._originals.clear()
        if CollectiveClock._installed is self:
            CollectiveClock._installed = None

    def take(self) -> float:
        """Seconds counted since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active or self._depth or threading.get_ident() != self._main:
                return original(*args, **kwargs)
            self._depth += 1
            began = time.perf_counter()
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)  # an injected slow collective (HPC_TRAIN_INJECT_FAULT=slow_comm:R:MS)
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds += time.perf_counter() - began
            return _TimedWork(result, self) if isinstance(result, distributed_c10d.Work) else result
        return timed


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def exposed_seconds(comm: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]) -> float:
    """The length of the communication intervals that no compute interval covers (the same time unit in, seconds
    out when the intervals are in seconds): on a GPU, NCCL kernels against every other kernel of the step."""
    covered = _union(compute)
    exposed = 0.0
    for start, end in _union(comm):
        length = end - start
        for low, high in covered:
            if high <= start:
                continue
            if low >= end:
                break
            length -= min(end, high) - max(start, low)
        exposed += max(0.0, length)
    return exposed
