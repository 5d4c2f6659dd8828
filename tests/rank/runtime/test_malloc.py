"""glibc's thresholds held fixed: memory a step frees at the heap's top is reused by the next step, not given back
and faulted in again; a user's own malloc settings are kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc_train.rank.runtime.malloc import _is_glibc, describe, steady_heap

pytestmark = pytest.mark.skipif(not _is_glibc(), reason="the thresholds are glibc's; this C library has none")

# Both scripts' start: the fix applied when argv[1] is "steady", and glibc's mallinfo2 to read the heap with.
PREAMBLE = """
import ctypes, sys
if sys.argv[1] == "steady":
    from hpc_train.rank.runtime.malloc import steady_heap
    assert steady_heap() is not None
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
"""

# A step's pattern in small: 6.4 MB in 64 KB blocks (each below glibc's starting mmap threshold, so on the heap),
# then all freed. The list that holds them is made once, before, and the round allocates nothing else on the heap:
# a list grown or made inside the round put its array above the blocks, and that fenced the heap's top off.
# Printed, over 20 rounds after 3 of warm-up, in a fresh process: the page faults per round, and the fewest bytes
# the heap gave back to the kernel in a round (mallinfo2's arena at the round's peak less after its free). The bytes
# given back are the mechanism and read the same on any kernel; the faults they cost depend on the kernel's page
# policy (with transparent huge pages on for the heap, one fault maps 2 MiB), so only the fixed side's faults, none,
# are asserted.
CHURN = PREAMBLE + """
import resource
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [None] * 100
def round_():
    for i in range(100):
        blocks[i] = bytearray(64 << 10)
    peak = mallinfo2().arena
    for i in range(100):
        blocks[i] = None
    return peak - mallinfo2().arena
for _ in range(3):
    round_()
before = faults()
given_back = min(round_() for _ in range(20))
print((faults() - before) / 20, given_back)
"""

# glibc's starting trim threshold (128 KiB), held for the unfixed side: in dynamic mode whatever the interpreter's
# start-up freed could have raised it, and that side is there to show that the pattern gives its top back.
STARTING_TRIM = {"MALLOC_TRIM_THRESHOLD_": str(128 << 10)}


# One block held (argv[2] MiB): with glibc's defaults a 16 MiB block gets its own mmap (the starting threshold is
# 128 KiB); with the threshold fixed at 32 MiB it comes from the heap, and a 48 MiB one still gets its own mmap.
# mallinfo2's hblks counts the mmapped blocks.
MMAPPED = PREAMBLE + """
before = mallinfo2().hblks
block = bytearray(int(sys.argv[2]) << 20)
print(mallinfo2().hblks - before)
"""

THRESHOLDS = """
from hpc_train.rank.runtime.malloc import steady_heap
heap = steady_heap({})
print(heap.mmap_threshold >> 20, heap.trim_threshold >> 20)
"""


def _run(script: str, *args: str, malloc_env: dict[str, str] | None = None) -> str:
    """``script``'s last line of output, in a fresh process whose allocator nobody set up but ``malloc_env``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(malloc_env or {})
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout
    return out.strip().splitlines()[-1]


def _churn(mode: str, malloc_env: dict[str, str] | None = None) -> tuple[float, int]:
    faults, given_back = _run(CHURN, mode, malloc_env=malloc_env).split()
    return float(faults), int(given_back)


def test_a_freed_heap_top_is_reused_instead_of_faulted_in_again() -> None:
    unfixed_faults, unfixed_given_back = _churn("default", STARTING_TRIM)
    assert unfixed_given_back > 3 << 20, (unfixed_given_back, unfixed_faults)  # 6.2 MB here; holes may hold some
    steady_faults, steady_given_back = _churn("steady")
    assert steady_given_back == 0, steady_given_back  # the fixed heap keeps its top for the next round
    assert steady_faults < 50, steady_faults  # so the next round touches pages it already has


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
