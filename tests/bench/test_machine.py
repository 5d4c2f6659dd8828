"""The machine line and the spread every benchmark prints: the CPU's name and whether it has native bf16 come
from /proc/cpuinfo's text (x86 and Arm), and a spread is min, median and max over the runs."""

from __future__ import annotations

import pytest

from hpc_train.bench import machine as machine_module
from hpc_train.bench.machine import machine, spread

X86 = "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t\t: fpu avx2 avx512_bf16\n" \
      "processor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t\t: fpu avx2 avx512_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize(("cpuinfo", "name", "bf16"), [
    (X86, "AMD EPYC 9654 96-Core Processor", True),
    (X86.replace(" avx512_bf16", ""), "AMD EPYC 9654 96-Core Processor", False),
])
def test_the_machine_line_names_the_cpu_and_its_bf16(monkeypatch: pytest.MonkeyPatch, cpuinfo: str, name: str,
                                                     bf16: bool) -> None:
    monkeypatch.setattr(machine_module, "read_cpuinfo", lambda: cpuinfo)
    found = machine()
    assert (found.cpu, found.native_bf16) == (name, bf16)
    line = found.line()
    assert line.startswith(f"machine: {name}, ") and f"native bf16 {'yes' if bf16 else 'no'}" in line
    assert "load average " in line


def test_a_cpu_without_a_model_name_is_still_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine_module, "read_cpuinfo", lambda: ARM)
    assert machine().cpu and not machine().native_bf16


def test_a_spread_is_min_median_and_max() -> None:
    assert spread([1.2, 0.9, 1.0, 1.1, 1.05]).text() == "1.050 (min 0.900, max 1.200, 5 runs)"
    assert spread([2.0]).text(1) == "2.0 (min 2.0, max 2.0, 1 run)"
    with pytest.raises(ValueError, match="no values"):
        spread([])
