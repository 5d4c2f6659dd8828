"""``train.precision = "auto"`` decided where the ranks run: bf16 on GPUs that support it, and on CPUs that
compute bf16 natively (``avx512_bf16`` or ``amx_bf16``); fp32 elsewhere, because emulated bf16 is several times
slower than fp32 (the tiny GPT on an AVX2-only CPU: ~2,000 tokens/s in bf16, ~17,600 in fp32). fp16 is never
chosen automatically: it needs loss scaling, which is a decision for the user.

:func:`decide_precision` is the pure decision (a fake cpuinfo text and a fake CUDA flag test it);
:func:`agreed_precision` probes this rank and makes every rank agree on the same answer, the weakest any rank
found, so a job on mixed nodes never trains half its ranks in another number format.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc_train.config.precision_rule import (
    CPU_BF16_MIN_HIDDEN,
    NATIVE_BF16_FLAGS,
    cpu_flags,
    decide_precision,
    read_cpuinfo,
)
from hpc_train.rank.distributed.collectives import all_reduce_values

__all__ = ["CPU_BF16_MIN_HIDDEN", "NATIVE_BF16_FLAGS", "agreed_precision", "cpu_flags", "decide_precision"]

# Codes for the agreement: the smallest wins, so fp32 (runs everywhere) beats bf16.
_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}


def _local_decision(requested: str, cuda: bool, hidden: int | None) -> tuple[str, str]:
    cuda_bf16 = bool(cuda and torch.cuda.is_bf16_supported())
    return decide_precision(requested, cuda=cuda, cuda_bf16=cuda_bf16, cpuinfo="" if cuda else read_cpuinfo(),
                            hidden=hidden)


def agreed_precision(requested: str, device: torch.device, hidden: int | None = None) -> tuple[str, str]:
    """This job's number format: ``requested`` when explicit; for ``"auto"`` each rank decides on its own
    hardware (``device`` is the rank's; ``hidden`` the model's width when known) and all ranks take the weakest
    answer (one all-reduce)."""
    if requested != "auto":
        return requested, "train.precision"
    precision, reason = _local_decision(requested, device.type == "cuda", hidden)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return precision, reason
    code = all_reduce_values([_CODES[precision]], "min", dtype=torch.int64)[0]
    agreed = next(name for name, value in _CODES.items() if value == code)
    if agreed != precision:
        return agreed, f"another rank cannot train in {precision} ({reason} here)"
    return precision, reason
