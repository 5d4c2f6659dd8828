"""``train.precision = "auto"``: the decision on a rank's hardware, from a fake cpuinfo text and CUDA flag."""

from __future__ import annotations

import pytest
import torch

from hpc_train.rank.train.precision import agreed_precision, cpu_flags, decide_precision

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx avx2\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
COOPER = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16\n"


def test_cpu_flags_reads_x86_flags_and_arm_features() -> None:
    assert {"avx2", "fma"} <= cpu_flags(AVX2_ONLY)
    assert "bf16" in cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags("") == set()


@pytest.mark.parametrize(("cpuinfo", "expected", "why"), [
    (AVX2_ONLY, "fp32", "CPU without native bf16: no avx512_bf16/amx_bf16"),
    (SAPPHIRE, "bf16", "CPU with native bf16: avx512_bf16, amx_bf16"),
    (COOPER, "bf16", "CPU with native bf16: avx512_bf16"),
    ("", "fp32", "CPU without native bf16: no avx512_bf16/amx_bf16"),
    ("flags : avx2 avx512_bf16_emulated\n", "fp32", "CPU without native bf16: no avx512_bf16/amx_bf16"),
])
def test_auto_on_cpu_takes_bf16_only_when_native(cpuinfo: str, expected: str, why: str) -> None:
    assert decide_precision("auto", cuda=False, cuda_bf16=False, cpuinfo=cpuinfo) == (expected, why)


def test_auto_on_a_native_bf16_cpu_keeps_fp32_for_a_model_too_narrow_to_gain() -> None:
    precision, why = decide_precision("auto", cuda=False, cuda_bf16=False, cpuinfo=SAPPHIRE, hidden=128)
    assert precision == "fp32" and "128 wide trains faster in fp32" in why
    assert decide_precision("auto", cuda=False, cuda_bf16=False, cpuinfo=SAPPHIRE, hidden=768)[0] == "bf16"
    assert decide_precision("auto", cuda=False, cuda_bf16=False, cpuinfo=AVX2_ONLY, hidden=768)[0] == "fp32"
    assert decide_precision("auto", cuda=True, cuda_bf16=True, cpuinfo="", hidden=128)[0] == "bf16"


def test_auto_on_gpu_follows_bf16_support_and_never_picks_fp16() -> None:
    assert decide_precision("auto", cuda=True, cuda_bf16=True, cpuinfo=AVX2_ONLY)[0] == "bf16"
    precision, why = decide_precision("auto", cuda=True, cuda_bf16=False, cpuinfo=SAPPHIRE)
    assert precision == "fp32" and "fp16 is never chosen automatically" in why


@pytest.mark.parametrize("explicit", ["bf16", "fp16", "fp32"])
def test_an_explicit_precision_is_kept_whatever_the_hardware(explicit: str) -> None:
    for cuda in (False, True):
        assert decide_precision(explicit, cuda=cuda, cuda_bf16=False, cpuinfo=AVX2_ONLY)[0] == explicit


def test_agreed_precision_without_a_process_group_is_the_local_decision() -> None:
    assert agreed_precision("fp32", torch.device("cpu")) == ("fp32", "train.precision")
    precision, why = agreed_precision("auto", torch.device("cpu"))
    assert precision in ("bf16", "fp32") and why.startswith("CPU")
