"""Preemption and time limits on the ranks: a signal only sets a flag; the ranks act on it together.

Slurm sends the site's signal (``USR2`` by default) ``lead_seconds`` before a time limit or a preemption, and
``SIGTERM`` when it ends or requeues a job itself. A handler that saved inside the signal would save mid-step on
one rank while the others sit in a collective; here the handler only records the signal. After every step (and
between evaluation batches) the ranks all-reduce the flag, so they stop at the same step boundary and save once.
After the site's signal rank 0 then requeues the job: ``scontrol requeue`` under Slurm (the same call submitit
makes), exit status 144 under submitit's local executor (its requeue code); after SIGTERM the run stops and
Slurm decides. A force-exit timer ends a save that hangs before Slurm's SIGKILL would leave no word of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_train.backends import Requeue, Runner, backend_of
from hpc_train.run.exit_codes import EXIT_SAVE_HUNG, EXIT_STOPPED

__all__ = ["PreemptionWatch", "Requeue", "arm_force_exit", "decide_requeue", "perform_requeue"]

class PreemptionWatch:
    """Records the first of ``signal_names`` (and SIGTERM) that arrives; :meth:`agreed` tells every rank whether
    any rank has one. Use as a context manager: handlers are restored on exit."""

    def __init__(self, signal_names: Sequence[str]) -> None:
        names = dict.fromkeys([*(n.upper().removeprefix("SIG") for n in signal_names), "TERM"])
        self.signals = [getattr(signal, f"SIG{name}") for name in names]
        self.received = 0
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._pending: Any = None  # a PendingReduce

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *_: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _on_signal(self, number: int, _frame: object) -> None:
        if not self.received:  # the first one counts: TERM after USR2 changes nothing
            self.received, self.received_at = number, time.time()

    def _start(self) -> Any:
        # Not at import time: the watch is installed before the ranks import torch.
        from hpc_train.rank.distributed.collectives import PendingReduce

        return PendingReduce([self.received], "max")

    def _finish_pending(self) -> int:
        if self._pending is None:
            return 0
        pending, self._pending = self._pending, None
        return pending.wait()[0]

    def agreed(self) -> int:
        """The signal number if any rank received one (the largest, so every rank gets the same), else 0.
        Blocking: for places that must decide now (between evaluation batches)."""
        earlier = self._finish_pending()
        if earlier:
            return earlier
        return self._start().wait()[0]

    def poll(self) -> int:
        """Like :meth:`agreed`, one step late and without waiting: returns what the all-reduce started at the
        previous call found, and starts the next one. Every rank calls it at the same steps, so every rank gets
        the same answer at the same step; the step does not wait for the round trip (a blocking all-reduce per
        step cost 5 % of a small model's step time)."""
        earlier = self._finish_pending()
        if not earlier:
            self._pending = self._start()
        return earlier

    def settle(self) -> None:
        """Wait for an all-reduce still in flight (before the process group goes away)."""
        self._finish_pending()


def arm_force_exit(seconds: float, log: Callable[[str], None]) -> threading.Timer:
    """Exit with :data:`EXIT_SAVE_HUNG` if the caller has not cancelled the timer within ``seconds``."""
    def expire() -> None:
        log(f"the save after the signal did not finish within {seconds:.0f} s; exiting with status "
            f"{EXIT_SAVE_HUNG} so that the job ends with a word (the previous checkpoint is still the good one)")
        os._exit(EXIT_SAVE_HUNG)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def decide_requeue(env: Mapping[str, str], enabled: bool, max_requeues: int, requeued_before: int,
                   requeue_signal: bool = True) -> Requeue:
    """Requeue when the signal was the site's preemption signal (not SIGTERM), the config allows it, this job has
    requeues left, and its backend (:mod:`hpc_train.backends`) can start it again.

    SIGTERM means Slurm is ending the job itself: ``scancel`` (which a requeue would undo: ``scontrol requeue``
    also takes back cancelled jobs), ``scontrol requeue`` from outside, or a preemption that requeues the job
    on its own. The run saves and stops; whatever sent the TERM decides what comes next."""
    if not requeue_signal:
        return Requeue("none", EXIT_STOPPED, "SIGTERM: Slurm is ending the job (cancelled, or requeued or "
                                             "preempted by Slurm itself, which then requeues it)")
    if not enabled:
        return Requeue("none", EXIT_STOPPED, "preempt.requeue is false")
    backend = backend_of(env)
    limit, why = backend.restart_limit(max_requeues)
    if requeued_before >= limit:
        return Requeue("none", EXIT_STOPPED, f"this job has requeued {requeued_before} times, {why}; "
                                             "resubmit to go on")
    return backend.next_attempt()


def perform_requeue(decision: Requeue, env: Mapping[str, str], run: Runner = subprocess.run,
                    run_dir: Path | None = None) -> Requeue:
    """Carry out ``decision`` through this process's backend; a failure becomes ``none`` with why."""
    return backend_of(env).requeue(decision, run_dir, run)
