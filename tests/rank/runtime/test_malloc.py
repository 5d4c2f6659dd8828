"""glibc's thresholds held fixed: memory a step frees at the heap's top is reused by the next step, not given back
and faulted in again; a user's own malloc settings are kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc_train.rank.runtime.malloc import MMAP_THRESHOLD, TRIM_THRESHOLD, SteadyHeap, steady_heap

GLIBC = hasattr(os, "confstr") and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
pytestmark = pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's; this C library has none")

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


def _faults_per_round(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout
    return float(out.strip().splitlines()[-1])


def test_a_freed_heap_top_is_reused_instead_of_faulted_in_again() -> None:
    default, steady = _faults_per_round("default"), _faults_per_round("steady")
    assert default > 1000, default  # glibc's defaults: 6.4 MB given back and faulted in again, about 1,600 pages
    assert steady < 50, steady  # fixed: the second round reuses the first's pages


def test_the_thresholds_are_glibc_s_own_ceilings() -> None:
    assert steady_heap({}) == SteadyHeap(32 << 20, 64 << 20) == SteadyHeap(MMAP_THRESHOLD, TRIM_THRESHOLD)


@pytest.mark.parametrize("environ", [{"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                     {"MALLOC_TOP_PAD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}],
                         ids=["trim", "mmap", "top-pad", "tunables"])
def test_a_user_s_own_malloc_settings_are_kept(environ: dict[str, str]) -> None:
    assert steady_heap(environ) is None
