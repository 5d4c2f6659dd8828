"""What a benchmark's reader needs to tell noise from a regression: the machine a figure was taken on (its CPU,
whether it computes bf16 natively, how busy it was) and the spread of a figure over runs, not one number.

Two readers on two machines compare these lines first: a ratio measured on a CPU with native bf16 and a load
average of 3 is not the same figure as one taken on an idle AVX2-only CPU. No torch import: the benchmarks print
this line before they start their ranks.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_train.config.precision_rule import NATIVE_BF16_FLAGS, cpu_flags, read_cpuinfo

__all__ = ["Machine", "Spread", "machine", "spread"]


@dataclass(frozen=True)
class Machine:
    cpu: str
    cpus: int
    native_bf16: bool
    load_average: float  # the 1-minute load average when the benchmark started

    def line(self) -> str:
        return (f"machine: {self.cpu}, {self.cpus} CPUs, native bf16 {'yes' if self.native_bf16 else 'no'}, "
                f"load average {self.load_average:.2f} at the start; python {platform.python_version()}")


def _cpu_name(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("model name", "cpu model", "hardware"):
            return " ".join(value.split())
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> Machine:
    """This machine, now."""
    cpuinfo = read_cpuinfo()
    return Machine(cpu=_cpu_name(cpuinfo), cpus=os.cpu_count() or 1,
                   native_bf16=bool(cpu_flags(cpuinfo) & set(NATIVE_BF16_FLAGS)), load_average=os.getloadavg()[0])


@dataclass(frozen=True)
class Spread:
    """A figure over runs: min, median and max."""

    low: float
    median: float
    high: float
    runs: int

    def text(self, digits: int = 3) -> str:
        return (f"{self.median:.{digits}f} (min {self.low:.{digits}f}, max {self.high:.{digits}f}, "
                f"{self.runs} run{'s' * (self.runs != 1)})")


def spread(values: Sequence[float]) -> Spread:
    """The spread of ``values`` (at least one)."""
    if not values:
        raise ValueError("spread: no values")
    return Spread(min(values), statistics.median(values), max(values), len(values))
