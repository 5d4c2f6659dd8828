"""Preemption and time limits on the ranks: a signal only sets a flag; the ranks act on it together.

Slurm sends the site's signal (``USR2`` by default) ``lead_seconds`` before a time limit or a preemption, and
``SIGTERM`` when it ends or requeues a job itself. A handler that saved inside the signal would save mid-step on
one rank while the others sit in a collective; here the handler only records the signal. Every few steps (a round
of about ``STEP_ROUND_S``) and between evaluation batches the ranks all-reduce the flag, so they stop at the same
step boundary and save once.
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

__all__ = ["FlagRounds", "PreemptionWatch", "Requeue", "arm_force_exit", "decide_requeue", "perform_requeue"]

# The trainer's steps hold one all-reduce of the flag about every this many seconds, and at least every this
# many steps: a step that waits for the round trip, or a host sync per step on a GPU, costs every step, while a
# signal comes at least 60 s (the site's lead) before the end. A run whose steps suddenly slow down learns of a
# signal up to twice that many steps late.
STEP_ROUND_S = 0.2
MAX_STEPS_PER_ROUND = 3


class FlagRounds:
    """Collective: every rank calls :meth:`tick` at the same points of its loop (a step, a ``should_stop()``),
    but not every call talks to the other ranks. A round (an all-reduce of the flag, started at one round and read
    at the next, so no call waits for it) happens every ``every`` calls. Each round also carries every rank's
    proposal for ``every`` (the calls that take about ``round_s``, from the spacing it measured), and all ranks
    take the largest, so they hold their rounds at the same calls and agree at the same one."""

    def __init__(self, round_s: float, max_calls: int) -> None:
        self.round_s, self.max_calls = round_s, max_calls
        self.calls = 0
        self.every = 1
        self._next_round = 1
        self._last_round: tuple[int, float] | None = None
        self._pending: Any = None  # a PendingReduce

    def tick(self, flag: int) -> int:
        """The largest ``flag`` of any rank, as it was at an earlier round, or 0 (no round due, or none had one)."""
        self.calls += 1
        if self.calls < self._next_round:
            return 0
        earlier = self.finish()
        now = time.monotonic()
        if not earlier:
            # Not at import time: the watch is installed before the ranks import torch.
            from hpc_train.rank.distributed.collectives import PendingReduce  # the flags go to the group's device

            self._pending = PendingReduce([flag, self._proposal(now)], "max")
        self._last_round = (self.calls, now)
        self._next_round = self.calls + self.every
        return earlier

    def finish(self) -> int:
        """Wait for the round in flight (before the process group goes away); its flag, or 0 without one."""
        if self._pending is None:
            return 0
        pending, self._pending = self._pending, None
        earlier, self.every = pending.wait()
        return earlier

    def _proposal(self, now: float) -> int:
        """How many calls make about ``round_s``, from the spacing since the last round (1 at first)."""
        if self._last_round is None:
            return 1
        calls, then = self._last_round
        spacing = (now - then) / max(1, self.calls - calls)
        return max(1, min(self.max_calls, int(self.round_s / spacing) if spacing > 0 else self.max_calls))


class PreemptionWatch:
    """Records the first of ``signal_names`` (and SIGTERM) that arrives; :meth:`agreed` tells every rank whether
    any rank has one. Use as a context manager: handlers are restored on exit. One per life: its rounds
    (:meth:`poll`) count the life's steps from its first."""

    def __init__(self, signal_names: Sequence[str]) -> None:
        names = dict.fromkeys([*(n.upper().removeprefix("SIG") for n in signal_names), "TERM"])
        self.signals = [getattr(signal, f"SIG{name}") for name in names]
        self.received = 0
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._rounds = FlagRounds(STEP_ROUND_S, MAX_STEPS_PER_ROUND)

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

    def agreed(self) -> int:
        """The signal number if any rank received one (the largest, so every rank gets the same), else 0.
        Blocking: for places that must decide now (between evaluation batches)."""
        earlier = self._rounds.finish()
        if earlier:
            return earlier
        from hpc_train.rank.distributed.collectives import PendingReduce  # not at import time, as in FlagRounds

        return PendingReduce([self.received], "max").wait()[0]

    def poll(self) -> int:
        """Like :meth:`agreed`, after every step and without waiting: a round (:class:`FlagRounds`) about every
        :data:`STEP_ROUND_S` of steps, read at the next round. Every rank calls it at the same steps, so every rank
        gets the same answer at the same step. (A blocking all-reduce per step cost 5 % of a small model's step
        time; an asynchronous one per step still cost its round trip on every step, and on a GPU a host sync.)"""
        return self._rounds.tick(self.received)

    def settle(self) -> None:
        """Wait for an all-reduce still in flight (before the process group goes away)."""
        self._rounds.finish()


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
