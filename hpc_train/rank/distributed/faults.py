"""Deliberate faults for testing failure handling on a real cluster: ``HPC_TRAIN_INJECT_FAULT``.

Values: ``raise:R`` (rank R raises), ``network:R`` (rank R raises NCCL's network error: an infrastructure
fault), ``hang:R`` (rank R sleeps forever), ``exit:R:CODE`` (rank R exits),
``signal:R:N`` (rank R sends itself signal N: 9 is a ``kill -9`` from outside, 11 a crash in native code),
``slow:R:MS`` (rank R spends MS more milliseconds in every forward pass: a straggler), ``slow_comm:R:MS`` (rank R
spends MS more milliseconds in every collective of a training step: a slow fabric, which its peers wait on),
``leak:R:MB`` (rank R keeps MB more megabytes after every training step: a memory leak), ``slow_save:R:MS``
(rank R spends MS more milliseconds in every checkpoint save: a slow file system).
``HPC_TRAIN_INJECT_FAULT_STEP=N`` fires the fault at training step N instead of at start-up, and
``HPC_TRAIN_INJECT_FAULT_RESTART=K`` only in the attempt with that Slurm restart count (so a requeued job can
show that it recovers), ``HPC_TRAIN_INJECT_FAULT_IN_PLACE=I`` only in the rank's life with that in-place restart
index (:mod:`hpc_train.rank.agent.agent`; 0 is the first life). Set them in a job's ``[env]``; unset, nothing happens.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

__all__ = ["FAULT_VARIABLE", "injected_comm_delay_s", "injected_delay_s", "injected_leak_bytes",
           "injected_save_delay_s", "maybe_inject_fault"]

FAULT_VARIABLE = "HPC_TRAIN_INJECT_FAULT"
STEP_VARIABLE = "HPC_TRAIN_INJECT_FAULT_STEP"
RESTART_VARIABLE = "HPC_TRAIN_INJECT_FAULT_RESTART"
IN_PLACE_VARIABLE = "HPC_TRAIN_INJECT_FAULT_IN_PLACE"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    argument: str
    step: int | None


def _fault(rank: int) -> Fault | None:
    """The fault aimed at ``rank`` in this attempt, if any."""
    spec = os.environ.get(FAULT_VARIABLE, "")
    kind, _, rest = spec.partition(":")
    target, _, argument = rest.partition(":")
    if not (target.isascii() and target.isdigit()) or int(target) != rank:
        return None
    restart = os.environ.get(RESTART_VARIABLE, "")
    if restart and restart != os.environ.get("SLURM_RESTART_COUNT", "0"):
        return None
    in_place = os.environ.get(IN_PLACE_VARIABLE, "")
    if in_place and in_place != os.environ.get("HPC_TRAIN_IN_PLACE", "0"):
        return None
    step = os.environ.get(STEP_VARIABLE, "")
    return Fault(kind, rank, argument, int(step) if (step.isascii() and step.isdigit()) else None)


def maybe_inject_fault(rank: int, step: int | None = None) -> None:
    """Raise, hang or exit on the rank the variable names, at start-up (``step`` None) or at its step."""
    fault = _fault(rank)
    if fault is None or fault.step != step:
        return
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} ({FAULT_VARIABLE}={os.environ[FAULT_VARIABLE]})")
    if fault.kind == "network":  # what NCCL raises when the fabric drops a connection
        raise RuntimeError(f"NCCL error: unhandled system error (injected on rank {rank}: "
                           f"{FAULT_VARIABLE}={os.environ[FAULT_VARIABLE]}), NET/IB : Got completion with error 12")
    if fault.kind == "hang":
        while True:
            time.sleep(60)
    if fault.kind == "exit":
        sys.exit(int(fault.argument or 1))
    if fault.kind == "signal" and fault.argument.isascii() and fault.argument.isdigit():
        os.kill(os.getpid(), int(fault.argument))
        time.sleep(60)  # a signal that does not end the process: it is not the fault the test wants


def _amount(rank: int, kind: str) -> int:
    """The number a ``kind:R:N`` fault aimed at ``rank`` carries; 0 without one."""
    fault = _fault(rank)
    if fault is None or fault.kind != kind or not (fault.argument.isascii() and fault.argument.isdigit()):
        return 0
    return int(fault.argument)


def injected_delay_s(rank: int) -> float:
    """Seconds a ``slow`` fault adds to each forward pass of ``rank``; 0 otherwise."""
    return _amount(rank, "slow") / 1000


def injected_comm_delay_s(rank: int) -> float:
    """Seconds a ``slow_comm`` fault adds to each collective of a training step on ``rank``; 0 otherwise."""
    return _amount(rank, "slow_comm") / 1000


def injected_leak_bytes(rank: int) -> int:
    """Bytes a ``leak`` fault keeps after each training step of ``rank``; 0 otherwise."""
    return _amount(rank, "leak") * 2**20


def injected_save_delay_s(rank: int) -> float:
    """Seconds a ``slow_save`` fault adds to each checkpoint save of ``rank``; 0 otherwise."""
    return _amount(rank, "slow_save") / 1000
