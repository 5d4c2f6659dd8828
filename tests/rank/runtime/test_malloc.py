"""glibc's thresholds held fixed: memory a step frees at the heap's top is reused by the next step, not given back
and faulted in again; a user's own malloc settings are kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc_train.rank.runtime.malloc import _is_glibc, describe, steady_heap

pytestmark = pytest.mark.skipif(not _is_glibc(), reason="the thresholds are glibc's; this C library has none")

# A step's pattern in small: 6.4 MB in 64 KB blocks (each below glibc's starting mmap threshold, so on the heap),
# then all freed at once. Page faults per round, measured after 3 rounds of warm-up, in a fresh process.
CHURN = """
import resource, sys
if sys.argv[1] == "steady":
    from hpc_train.rank.runtime.malloc import steady_heap
    assert steady_heap() is not None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def round_():
    blocks = [bytearray(64 << 10) for _ in range(100)]
    del blocks
for _ in range(3):
    round_()
before = faults()
for _ in range(20):
    round_()
print((faults() - before) / 20)
"""


# One block held (argv[2] MiB): with glibc's defaults a 16 MiB block gets its own mmap (the starting threshold is
# 128 KiB); with the threshold fixed at 32 MiB it comes from the heap, and a 48 MiB one still gets its own mmap.
# mallinfo2's hblks counts the mmapped blocks.
MMAPPED = """
import ctypes, sys
if sys.argv[1] == "steady":
    from hpc_train.rank.runtime.malloc import steady_heap
    assert steady_heap() is not None
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
before = mallinfo2().hblks
block = bytearray(int(sys.argv[2]) << 20)
print(mallinfo2().hblks - before)
"""

THRESHOLDS = """
from hpc_train.rank.runtime.malloc import steady_heap
heap = steady_heap({})
print(heap.mmap_threshold >> 20, heap.trim_threshold >> 20)
"""


def _run(script: str, *args: str) -> str:
    """``script``'s last line of output, in a fresh process whose allocator nobody set up."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout
    return out.strip().splitlines()[-1]


def _faults_per_round(mode: str) -> float:
    return float(_run(CHURN, mode))


def test_a_freed_heap_top_is_reused_instead_of_faulted_in_again() -> None:
    default, steady = _faults_per_round("default"), _faults_per_round("steady")
    assert default > 1000, default  # glibc's defaults: 6.4 MB given back and faulted in again, about 1,600 pages
    assert steady < 50, steady  # fixed: the second round reuses the first's pages


def test_a_block_below_32_mib_comes_from_the_heap_not_its_own_mmap() -> None:
    assert _run(MMAPPED, "default", "16") == "1"
    assert _run(MMAPPED, "steady", "16") == "0"
    assert _run(MMAPPED, "steady", "48") == "1"


def test_the_thresholds_are_the_highest_that_glibc_s_dynamic_mode_sets() -> None:
    assert _run(THRESHOLDS) == "32 64"  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, and twice it


@pytest.mark.parametrize("environ", [{"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                     {"MALLOC_TOP_PAD_": "0"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.check=0:glibc.malloc.trim_threshold=0"}],
                         ids=["trim", "mmap", "top-pad", "tunables"])
def test_a_user_s_own_thresholds_are_kept(environ: dict[str, str]) -> None:
    assert steady_heap(environ) is None
    assert describe(None).startswith("malloc: glibc's thresholds left as they are")


def test_other_tunables_do_not_stop_the_fix() -> None:
    assert _run(THRESHOLDS.replace("steady_heap({})", 'steady_heap({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})')
                ) == "32 64"
