"""Model FLOPs utilisation (MFU): how much of the accelerator's peak the training step turns into model math.

Tokens per second alone cannot tell a slow model from a slow job; MFU divides the FLOPs the model needs
(counted from its shape, not measured) by what the device could do at most. The count follows the PaLM paper,
appendix B (Chowdhery et al. 2022, https://arxiv.org/abs/2204.02311) as nanoGPT's ``estimate_mfu`` does
(https://github.com/karpathy/nanoGPT/blob/master/model.py). Recomputation (activation checkpointing) is not
counted: that is what makes it *model* FLOPs utilisation rather than hardware FLOPs utilisation.

Peak numbers are dense (no 2:4 sparsity) tensor-core figures from vendor datasheets. A device or dtype this
table does not know gets ``inf``, so MFU reads 0 instead of a plausible-looking wrong number; CPUs always do.
Pure Python: no torch import, so the login-node tools can use it too.
"""

from __future__ import annotations

import math
import re

__all__ = ["PEAK_FLOPS", "flops_per_token", "mfu", "normalize_dtype", "peak_flops"]


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder-only transformer: ``6*N + 12*L*H*T``.

    ``6*N``: a forward (2 FLOPs per weight: multiply and add) and a backward (twice the forward) through every
    weight matrix. ``12*L*H*T``: the attention score and value products, ``Q@K^T`` and ``A@V``, which hold no
    weights: 2 matmuls x 2 FLOPs x T x H per layer forward, times 3 with the backward. PaLM writes this
    ``12*L*H*Q*T`` with H heads of size Q; here ``hidden`` is heads x head size (the model width). The causal
    mask is not subtracted, as in PaLM and nanoGPT, so numbers compare with published MFUs.

    What ``params`` (N) should count, explicitly: every parameter that takes part in a matmul per token. That
    is all parameters except the *position* embedding table (a lookup, no FLOPs). The token embedding stays
    in: its matrix is also (tied or not) the output projection to the vocabulary, a real ``H x V`` matmul per
    token. This is nanoGPT's ``get_num_params(non_embedding=True)``, which subtracts only ``wpe``; for GPT-2
    124M that is 124,439,808 - 1024 x 768 = 123,653,376. An untied model with its own LM head counts the head
    and may leave the input embedding out. Biases and norms are in N too; they are rounding error.
    """
    for name, value in (("params", params), ("layers", layers), ("hidden", hidden), ("seq_len", seq_len)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return float(6 * params + 12 * layers * hidden * seq_len)


_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def normalize_dtype(dtype: str) -> str:
    """``"torch.bfloat16"``, ``"bfloat16"``, ``"BF16"`` -> ``"bf16"``; unknown names come back lower-cased.

    ``fp32`` means plain FP32 (CUDA cores). PyTorch does not use TF32 for matmuls unless
    ``torch.backends.cuda.matmul.allow_tf32`` (or ``set_float32_matmul_precision("high")``) is set; pass
    ``"tf32"`` then.
    """
    key = dtype.strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


# Dense peak FLOP/s per device, most specific pattern first: the first regex that matches the lower-cased
# ``torch.cuda.get_device_name()`` wins (e.g. "h100 pcie" before "h100", "gh200" before "h200", "l40s"
# before "l40" before "l4"). Values are per device as torch sees it.
_T = 1e12
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    # NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/): the sparsity figures halved.
    # (H800 / A800: the export variants, same compute as H100 / A100.)
    # PCIe: BF16/FP16 756, TF32 378, FP32 51, FP8 1513. NVL: BF16 835, TF32 418, FP32 60, FP8 1671.
    (r"h[18]00.*pcie", {"bf16": 756 * _T, "fp16": 756 * _T, "tf32": 378 * _T, "fp32": 51 * _T, "fp8": 1513 * _T}),
    (r"h100.*nvl", {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T, "fp8": 1671 * _T}),
    # H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): H200 NVL as H100 NVL.
    (r"h200.*nvl", {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T, "fp8": 1671 * _T}),
    # GH200, H200 SXM and H100 SXM ("NVIDIA H100 80GB HBM3") share the Hopper SXM figures:
    # BF16/FP16 989, TF32 495, FP32 67, FP8 1979.
    (r"gh200|h200|h100|h800", {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 495 * _T, "fp32": 67 * _T,
                               "fp8": 1979 * _T}),
    # NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/), SXM4 and PCIe alike:
    # BF16/FP16 312, TF32 156, FP32 19.5. No FP8 on Ampere.
    (r"a100|a800", {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T}),
    # V100 datasheet (https://www.nvidia.com/en-us/data-center/v100/): FP16 tensor 112 (PCIe) / 125 (SXM2) /
    # 130 (V100S), FP32 14 / 15.7 / 16.4. No BF16 tensor cores on Volta, so bf16 is unknown (inf).
    (r"v100s", {"fp16": 130 * _T, "fp32": 16.4 * _T}),
    (r"v100.*pcie", {"fp16": 112 * _T, "fp32": 14 * _T}),
    (r"v100", {"fp16": 125 * _T, "fp32": 15.7 * _T}),
    # L40S / L40 / L4 datasheets (https://www.nvidia.com/en-us/data-center/l40s/, .../l40/, .../l4/).
    (r"l40s", {"bf16": 362 * _T, "fp16": 362 * _T, "tf32": 183 * _T, "fp32": 91.6 * _T, "fp8": 733 * _T}),
    (r"l40\b", {"bf16": 181 * _T, "fp16": 181 * _T, "tf32": 90.5 * _T, "fp32": 90.5 * _T, "fp8": 362 * _T}),
    (r"\bl4\b", {"bf16": 121 * _T, "fp16": 121 * _T, "tf32": 60 * _T, "fp32": 30.3 * _T, "fp8": 242.5 * _T}),
    # AMD MI300X datasheet (https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html):
    # BF16/FP16 1307.4, TF32 653.7, FP32 matrix 163.4, FP8 2614.9.
    (r"mi300x", {"bf16": 1307.4 * _T, "fp16": 1307.4 * _T, "tf32": 653.7 * _T, "fp32": 163.4 * _T,
                 "fp8": 2614.9 * _T}),
    # AMD MI250X datasheet: BF16/FP16 383, FP32 matrix 95.7 per OAM package, which holds two GCDs that torch
    # lists as two devices; per device, half.
    (r"mi250x", {"bf16": 191.5 * _T, "fp16": 191.5 * _T, "fp32": 47.9 * _T}),
)


def peak_flops(device_name: str, dtype: str) -> float:
    """Dense peak FLOP/s of one device for ``dtype`` (``"bf16"``, ``"torch.float16"``, ``"fp32"``, ...).

    ``device_name`` is what ``torch.cuda.get_device_name()`` returns (or ``"cpu"``). Unknown devices, unknown
    dtypes and CPUs give ``float("inf")``: MFU then reads 0, which is visibly "not measured", where a guessed
    peak would give a believable but wrong percentage.
    """
    name = device_name.strip().lower()
    if not name or name == "cpu" or "cpu" in name.split():
        return math.inf
    key = normalize_dtype(dtype)
    for pattern, table in PEAK_FLOPS:
        if re.search(pattern, name):
            return table.get(key, math.inf)
    return math.inf


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation as a fraction (0.45 = 45 %): ``tokens_per_s * flops_per_token / peak``.

    ``tokens_per_s`` and ``peak`` must cover the same devices: tokens per second of one device with the peak
    of one device, or the whole job's tokens with ``peak * world_size``. An infinite peak (unknown device) or
    a zero FLOP count gives 0.
    """
    if peak <= 0 or math.isnan(peak):
        raise ValueError(f"peak FLOP/s must be > 0, got {peak}")
    if math.isinf(peak) or tokens_per_s <= 0 or flops_per_token <= 0:
        return 0.0
    return tokens_per_s * flops_per_token / peak
