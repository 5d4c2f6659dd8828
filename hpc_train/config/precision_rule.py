"""The rule ``train.precision = "auto"`` follows, without torch: the login node's plan applies it to what it can
know of the nodes (this machine's CPU for the local executor), the ranks to their own hardware
(:mod:`hpc_train.rank.train.precision`)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CPU_BF16_MIN_HIDDEN", "NATIVE_BF16_FLAGS", "cpu_flags", "decide_precision", "read_cpuinfo"]

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# On a CPU with AMX (2 ranks, ZeRO-2, this repository's GPT) bf16 ran at 0.85 of fp32's tokens/s for a model 128
# wide and at 1.56 for one 768 wide (docs/performance.md): below this width fp32 is the faster choice.
CPU_BF16_MIN_HIDDEN = 512


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


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""  # no cpuinfo (not Linux): no native bf16 known, fp32
