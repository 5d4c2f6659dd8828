"""Preemption for user programs: ``ctx.should_stop()`` for programs that ask, and a requeue for those that don't.

A program that asks learns of the signal at the same call on every rank (an all-reduce about every 0.1 s of
its loop, started at one call and read at a later one, so the loop never waits for it), saves, and returns;
hpc_train then records the attempt and requeues it. A program that never asks (a plain script) cannot save on
a signal; once the signal has come and no ``should_stop()`` call followed within a grace period, rank 0
records the attempt and requeues the job, and the next attempt resumes from whatever the program saved itself.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from hpc_train.config.plan import Plan
from hpc_train.run.exit_codes import EXIT_STOPPED, LOCAL_REQUEUE_EXIT
from hpc_train.run.loglines import format_stopped
from hpc_train.train.preemption import PreemptionWatch, Requeue, arm_force_exit
from hpc_train.train.stopping import AttemptRecorder, signal_name

__all__ = ["StopAgreement", "UnaskedStop", "grace_seconds"]


def grace_seconds(lead_seconds: int) -> float:
    """How long after a signal a program has to ask ``should_stop()`` before hpc_train requeues it anyway:
    a sixth of the lead time, between 5 and 60 s (a loop asks once a step; the rest of the lead is its save)."""
    return float(min(60, max(5, lead_seconds // 6)))


# One all-reduce of the stop flag about every this many seconds of the program's loop, however short its steps,
# and at most every this many calls: a loop that suddenly slows down learns of a signal that many calls late.
ROUND_S = 0.1
MAX_CALLS_PER_ROUND = 100


class StopAgreement:
    """What ``ctx.should_stop()`` does; collective (every rank calls it at the same points of its loop).

    Not every call talks to the other ranks: a round (one all-reduce of the flag, started at one round and read
    at the next, so no call waits for it) happens every ``every`` calls. Each round also carries every rank's
    proposal for ``every`` (the calls that take about :data:`ROUND_S`, from the spacing it measured), and all
    ranks take the largest, so they hold their rounds at the same calls and stop at the same one."""

    def __init__(self, plan: Plan, watch: PreemptionWatch, recorder: AttemptRecorder,
                 log: Callable[[str], None]) -> None:
        self.plan, self.watch, self.recorder, self.log = plan, watch, recorder, log
        self.asked = threading.Event()
        self.signum = 0
        self.decision: Requeue | None = None
        self.calls = 0
        self.every = 1
        self._next_round = 1
        self._last_round: tuple[int, float] | None = None
        self._pending: tuple[Any, Any] | None = None
        self._timer: threading.Timer | None = None

    def ask(self, step: int) -> bool:
        """True on every rank, at the same call, once any rank has the preemption or time-limit signal."""
        self.asked.set()
        if self.decision is not None:
            return True
        self.calls += 1
        if self.calls < self._next_round:
            return False
        signum = self._round()
        if not signum:
            return False
        self.signum = signum
        name, preempt = signal_name(signum), self.plan.config.preempt
        self.decision = self.recorder.decide_stop(signum, name == f"SIG{self.plan.signal}", preempt.requeue,
                                                  preempt.max_requeues)
        received = self.watch.received_at or time.time()
        budget = max(10.0, self.plan.lead_seconds - (time.time() - received) - 5)
        self.log(f"{name} received: should_stop() is True after step {step}; save and return within {budget:.0f} s")
        self._timer = arm_force_exit(budget, self.log)
        return True

    def _proposal(self, now: float) -> int:
        """How many calls make about :data:`ROUND_S`, from the spacing since the last round (1 at first)."""
        if self._last_round is None:
            return 1
        calls, then = self._last_round
        spacing = (now - then) / max(1, self.calls - calls)
        return max(1, min(MAX_CALLS_PER_ROUND, int(ROUND_S / spacing) if spacing > 0 else MAX_CALLS_PER_ROUND))

    def _round(self) -> int:
        """Read the previous round's answer (the signal, the agreed spacing) and start the next round."""
        from hpc_train.distributed.collectives import PendingReduce  # the flags go to the group's device

        earlier = 0
        if self._pending is not None:
            earlier, self.every = self._pending.wait()
            self._pending = None
        now = time.monotonic()
        if not earlier:
            self._pending = PendingReduce([self.watch.received, self._proposal(now)], "max")
        self._last_round = (self.calls, now)
        self._next_round = self.calls + self.every
        return earlier

    def settle(self) -> None:
        """The program has returned: no force exit any more, and no all-reduce left in flight."""
        if self._timer is not None:
            self._timer.cancel()
        if self._pending is not None:
            with contextlib.suppress(RuntimeError):  # the program destroyed its group after our last all-reduce
                self._pending.wait()
            self._pending = None


class UnaskedStop:
    """A thread that requeues a program that does not ask ``should_stop()`` after a signal (see the module)."""

    def __init__(self, plan: Plan, rank: int, watch: PreemptionWatch, recorder: AttemptRecorder,
                 asked: Callable[[], threading.Event | None], last_step: Callable[[], int],
                 log: Callable[[str], None], exit: Callable[[int], None] = os._exit) -> None:
        self.plan, self.rank, self.watch, self.recorder = plan, rank, watch, recorder
        self.asked, self.last_step, self.log, self._exit = asked, last_step, log, exit
        self.grace_s = grace_seconds(plan.lead_seconds)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc_train-unasked-stop", daemon=True)

    def __enter__(self) -> UnaskedStop:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._done.wait(0.2):
            if not self.watch.received:
                continue
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and not self._done.is_set():
                event = self.asked()
                if event is not None and event.is_set():
                    return  # the program asks: it stops by itself
                time.sleep(0.2)
            if not self._done.is_set():
                self._act(self.watch.received)
            return

    def _act(self, signum: int) -> None:
        name = signal_name(signum)
        requeue_signal = name == f"SIG{self.plan.signal}"
        local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
        self.log(f"{name} received and the program did not ask should_stop() within {self.grace_s:.0f} s: "
                 "stopping it here; the next attempt starts the program again, which resumes from what it saved")
        if self.rank != 0:
            if local or not requeue_signal:
                self._exit(LOCAL_REQUEUE_EXIT if local and requeue_signal else EXIT_STOPPED)
            return  # under Slurm rank 0 requeues the job, which ends this rank
        preempt = self.plan.config.preempt
        decision = self.recorder.requeue_decision(requeue_signal, preempt.requeue, preempt.max_requeues)
        done = self.recorder.record_stop(self.last_step(), signum, decision, "the program did not ask should_stop(); ")
        self.log(format_stopped(self.last_step(), name, done.action, done.reason, done.exit_code))
        self._exit(done.exit_code)
