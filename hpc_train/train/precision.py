"""``train.precision = "auto"`` decided where the ranks run: bf16 on GPUs that support it, and on CPUs that
compute bf16 natively (``avx512_bf16`` or ``amx_bf16``); fp32 elsewhere, because emulated bf16 is several times
slower than fp32 (the tiny GPT on an AVX2-only CPU: ~2,000 tokens/s in bf16, ~17,600 in fp32). fp16 is never
chosen automatically: it needs loss scaling, which is a decision for the user.

:func:`decide_precision` is the pure decision (a fake cpuinfo text and a fake CUDA flag test it);
:func:`agreed_precision` probes this rank and makes every rank agree on the same answer, the weakest any rank
found, so a job on mixed nodes never trains half its ranks in another number format.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from hpc_train.distributed.collectives import all_reduce_values

__all__ = ["CPU_BF16_MIN_HIDDEN", "NATIVE_BF16_FLAGS", "agreed_precision", "cpu_flags", "decide_precision"]

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# On a CPU with AMX (2 ranks, ZeRO-2, this repository's GPT) bf16 ran at 0.85 of fp32's tokens/s for a model 128
# wide and at 1.56 for one 768 wide (docs/performance.md): below this width fp32 is the faster choice.
CPU_BF16_MIN_HIDDEN = 512
# Codes for the agreement: the smallest wins, so fp32 (runs everywhere) beats bf16.
_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The CPU feature flags of a ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def decide_precision(requested: str, *, cuda: bool, cuda_bf16: bool, cpuinfo: str,
                     hidden: int | None = None) -> tuple[str, str]:
    """The number format to train in and why. ``requested`` other than ``"auto"`` is kept as it is; ``cuda`` says
    whether this rank trains on a GPU and ``cuda_bf16`` whether that GPU supports bf16; ``hidden`` is the model's
    width when it is known before the model is built (a GPT preset), else None."""
    if requested != "auto":
        return requested, "train.precision"
    if cuda:
        if cuda_bf16:
            return "bf16", "GPU with bf16 support"
        return "fp32", "GPU without bf16 support; fp16 is never chosen automatically"
    found = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags(cpuinfo)]
    if found and hidden is not None and hidden < CPU_BF16_MIN_HIDDEN:
        return "fp32", (f"CPU with native bf16 ({', '.join(found)}), but a model {hidden} wide trains faster in fp32: "
                        f"its matrices are too small for bf16 to repay the casts (below {CPU_BF16_MIN_HIDDEN})")
    if found:
        return "bf16", f"CPU with native bf16: {', '.join(found)}"
    return "fp32", "CPU without native bf16: no " + "/".join(NATIVE_BF16_FLAGS)


def _read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""  # no cpuinfo (not Linux): no native bf16 known, fp32


def _local_decision(requested: str, cuda: bool, hidden: int | None) -> tuple[str, str]:
    cuda_bf16 = bool(cuda and torch.cuda.is_bf16_supported())
    return decide_precision(requested, cuda=cuda, cuda_bf16=cuda_bf16, cpuinfo="" if cuda else _read_cpuinfo(),
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
