"""Deliberate faults for testing failure handling on a real cluster: ``HPC_TRAIN_INJECT_FAULT``.

Values: ``raise:R`` (rank R raises), ``hang:R`` (rank R sleeps forever), ``exit:R:CODE`` (rank R exits).
Set it in a job's ``[env]`` to see what a failing rank looks like; unset, it does nothing.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["maybe_inject_fault", "FAULT_VARIABLE"]

FAULT_VARIABLE = "HPC_TRAIN_INJECT_FAULT"


def maybe_inject_fault(rank: int) -> None:
    """Raise, hang or exit on the rank the variable names; return at once otherwise."""
    spec = os.environ.get(FAULT_VARIABLE, "")
    if not spec:
        return
    kind, _, rest = spec.partition(":")
    target, _, code = rest.partition(":")
    if not target.isdigit() or int(target) != rank:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} ({FAULT_VARIABLE}={spec})")
    if kind == "hang":
        while True:
            time.sleep(60)
    if kind == "exit":
        sys.exit(int(code or 1))
