"""FLOPs per token, the peak table and MFU, checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from hpc_train.rank.runtime.flops import PEAK_FLOPS, flops_per_token, mfu, normalize_dtype, peak_flops

# GPT-2 124M as nanoGPT counts it: all parameters but the position embedding (124,439,808 - 1024 * 768).
GPT2_N = 123_653_376
GPT2_L, GPT2_H, GPT2_T = 12, 768, 1024


def test_gpt2_124m_flops_per_token_by_hand() -> None:
    six_n = 6 * 123_653_376  # 741,920,256
    attention = 12 * 12 * 768 * 1024  # 113,246,208
    assert six_n == 741_920_256 and attention == 113_246_208
    assert flops_per_token(GPT2_N, GPT2_L, GPT2_H, GPT2_T) == 855_166_464.0


def test_gpt2_124m_mfu_on_a100_by_hand() -> None:
    # 100k tokens/s on one A100 in bf16: 1e5 * 855,166,464 / 312e12 = 0.27409...
    per_token = flops_per_token(GPT2_N, GPT2_L, GPT2_H, GPT2_T)
    peak = peak_flops("NVIDIA A100-SXM4-80GB", "bf16")
    assert peak == 312e12
    assert mfu(100_000, per_token, peak) == pytest.approx(855_166_464e5 / 312e12)
    assert mfu(100_000, per_token, peak) == pytest.approx(0.274092, abs=1e-6)
    # the whole job's tokens against the whole job's peak is the same ratio
    assert mfu(8 * 100_000, per_token, 8 * peak) == pytest.approx(mfu(100_000, per_token, peak))


@pytest.mark.parametrize(("name", "dtype", "expected"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H200", "torch.bfloat16", 989e12),
    ("NVIDIA GH200 480GB", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "fp16", 835e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
    ("NVIDIA A100 80GB PCIe", "float16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
    ("Tesla V100-SXM2-32GB", "fp16", 125e12),
    ("Tesla V100-PCIE-16GB", "fp16", 112e12),
    ("NVIDIA L40S", "bf16", 362e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("AMD Instinct MI300X", "bf16", 1307.4e12),
])
def test_peak_table_most_specific_first(name: str, dtype: str, expected: float) -> None:
    assert peak_flops(name, dtype) == expected


@pytest.mark.parametrize(("name", "dtype"), [
    ("cpu", "fp32"),
    ("CPU", "bf16"),
    ("", "bf16"),
    ("NVIDIA GeForce RTX 4090", "bf16"),  # not in the table: no guess
    ("Some Future Accelerator", "fp16"),
    ("Tesla V100-SXM2-32GB", "bf16"),  # Volta has no bf16 tensor cores
    ("NVIDIA A100-SXM4-80GB", "fp8"),  # nor Ampere fp8
    ("NVIDIA H100 80GB HBM3", "int4"),
])
def test_unknown_device_or_dtype_is_inf_and_mfu_zero(name: str, dtype: str) -> None:
    peak = peak_flops(name, dtype)
    assert math.isinf(peak)
    assert mfu(1e6, 1e9, peak) == 0.0


def test_mfu_edges() -> None:
    assert mfu(0.0, 1e9, 312e12) == 0.0
    assert mfu(1e5, 0.0, 312e12) == 0.0
    with pytest.raises(ValueError, match="peak"):
        mfu(1e5, 1e9, 0.0)
    with pytest.raises(ValueError, match="layers"):
        flops_per_token(1, -1, 1, 1)


def test_dtype_names() -> None:
    assert normalize_dtype("torch.bfloat16") == normalize_dtype("BF16") == "bf16"
    assert normalize_dtype("half") == "fp16"
    assert normalize_dtype("float32") == "fp32"


def test_table_values_and_specific_rows_win() -> None:
    # every entry a positive finite number; the rows a broader pattern would also match still reach their own
    for _, table in PEAK_FLOPS:
        assert table and all(0 < value < 1e16 for value in table.values())
    assert peak_flops("NVIDIA H100 PCIe", "bf16") < peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak_flops("NVIDIA L40", "bf16") == 181e12
    assert peak_flops("Tesla V100S-PCIE-32GB", "fp16") == 130e12
