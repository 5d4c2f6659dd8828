"""glibc's allocator held at fixed thresholds for a rank's life, so that a step does not give heap back to the
kernel and then fault it in again.

By default glibc moves two thresholds while a process runs. A block above ``M_MMAP_THRESHOLD`` gets its own
``mmap``, and free memory above ``M_TRIM_THRESHOLD`` at the top of the heap goes back to the kernel. Where the two
end up depends on what the process allocated and freed before: its imports, its set-up, a ``gc.collect``. So two
processes that run the same step can behave differently.

A rank of the quick start gave its heap's top back and took it again about 40 times a second: ``brk`` up and down
by 2 MB, and 41,000 page faults a second on rank 0. A hand-written DeepSpeed loop of the same model had 15,000. That
cost 5 % of a step (``benchmarks/trainer_overhead.py``; docs/performance.md). The fixed values are glibc's own
ceilings, the most its dynamic mode ever sets: 32 MiB and twice that. A process that frees a 32 MiB block gets them
anyway, so nothing here is outside what glibc already does; they only hold from the start.

The cost: each of glibc's arenas (the main heap, and one per thread that allocates, up to 8 per core) may keep up
to 64 MiB of freed memory, and blocks of 128 KiB to 32 MiB now come from the heap rather than their own ``mmap``,
so fragmentation can keep more. Forked data-loader workers inherit the settings.

A user who sets ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or the same three
``glibc.malloc`` tunables in the rank's environment keeps their choice.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "SteadyHeap", "describe", "steady_heap"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the highest its dynamic mode goes
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what the dynamic mode sets beside it
_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_USERS_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad")


@dataclass(frozen=True)
class SteadyHeap:
    """The thresholds this process now runs with, in bytes."""

    mmap_threshold: int
    trim_threshold: int


def _is_glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not a GNU C library (musl, macOS)
        return False


def _users_own(environ: Mapping[str, str]) -> bool:
    tunables = [item.split("=", 1)[0] for item in environ.get("GLIBC_TUNABLES", "").split(":")]
    return any(name in environ for name in _USERS_OWN) or any(name in _USERS_TUNABLES for name in tunables)


def steady_heap(environ: Mapping[str, str] = os.environ) -> SteadyHeap | None:
    """Fix glibc's mmap and trim thresholds for this process (for good: glibc's dynamic mode stays off). None where
    the C library is not glibc, ``environ`` holds the user's own thresholds, or glibc refused the mmap threshold
    (then nothing changed)."""
    if not _is_glibc() or _users_own(environ):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return None
    return SteadyHeap(MMAP_THRESHOLD, TRIM_THRESHOLD)


def describe(heap: SteadyHeap | None) -> str:
    """Rank 0's log line about the allocator."""
    if heap is None:
        return ("malloc: glibc's thresholds left as they are (not glibc, or the user's own MALLOC_*_THRESHOLD_, "
                "MALLOC_TOP_PAD_ or glibc.malloc tunables)")
    return (f"malloc: mmap threshold {heap.mmap_threshold >> 20} MiB, trim threshold {heap.trim_threshold >> 20} MiB, "
            "fixed for the rank's life")
