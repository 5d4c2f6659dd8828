"""Preemption for user programs: ``ctx.should_stop()`` for programs that ask, and a requeue for those that don't.

A program that asks learns of the signal at the same call on every rank (an all-reduce about every 0.1 s of
its loop, started at one call and read at a later one, so the loop never waits for it), saves, and returns;
hpc_train then records the attempt and requeues it. A program that never asks (a plain script) cannot save on
a signal; once the signal has come and no ``should_stop()`` call followed within a grace period, rank 0
records the attempt and requeues the job, every rank leaves with it (:class:`UnaskedStop`), and the next
attempt resumes from whatever the program saved itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hpc_train.config.plan import Plan
from hpc_train.rank.runtime.preemption import FlagRounds, PreemptionWatch, Requeue, arm_force_exit
from hpc_train.rank.runtime.stopping import AttemptRecorder, signal_name
from hpc_train.run.exit_codes import EXIT_STOPPED
from hpc_train.run.loglines import format_stopped
from hpc_train.run.stops import (
    StopConsequence,
    StopNotice,
    publish_notice,
    read_notice,
    read_request,
    request_stop,
    wait_for_done,
)

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
    """What ``ctx.should_stop()`` does; collective (every rank calls it at the same points of its loop). Not every
    call talks to the other ranks: :class:`FlagRounds` holds a round about every :data:`ROUND_S` of the loop, so
    the ranks stop at the same call."""

    def __init__(self, plan: Plan, watch: PreemptionWatch, recorder: AttemptRecorder,
                 log: Callable[[str], None]) -> None:
        self.plan, self.watch, self.recorder, self.log = plan, watch, recorder, log
        self.asked = threading.Event()
        self.signum = 0
        self.decision: Requeue | None = None
        self._rounds = FlagRounds(ROUND_S, MAX_CALLS_PER_ROUND)
        self._timer: threading.Timer | None = None

    def ask(self, step: int) -> bool:
        """True on every rank, at the same call, once any rank has the preemption or time-limit signal."""
        self.asked.set()
        if self.decision is not None:
            return True
        signum = self._rounds.tick(self.watch.received)
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

    @property
    def every(self) -> int:
        """The calls between two rounds, as the ranks last agreed."""
        return self._rounds.every

    def settle(self) -> None:
        """The program has returned: no force exit any more, and no all-reduce left in flight."""
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(RuntimeError):  # the program destroyed its group after our last all-reduce
            self._rounds.finish()


class UnaskedStop:
    """A thread on every rank that stops a program that does not ask ``should_stop()`` after a signal: all ranks
    together, through rank 0's stop notice (:mod:`hpc_train.run.stops`), so no rank outlives its peers."""

    def __init__(self, plan: Plan, rank: int, watch: PreemptionWatch, recorder: AttemptRecorder,
                 asked: Callable[[], threading.Event | None], last_step: Callable[[], int | None],
                 log: Callable[[str], None], run_dir: Path, attempt: str,
                 exit: Callable[[int], None] = os._exit, *, poll_s: float = 0.2, done_timeout_s: float = 90.0,
                 linger_s: float = 1.5) -> None:
        self.plan, self.rank, self.watch, self.recorder = plan, rank, watch, recorder
        self.asked, self.last_step, self.log, self._exit = asked, last_step, log, exit
        self.run_dir, self.attempt = run_dir, attempt
        self.grace_s = grace_seconds(plan.lead_seconds)
        self.poll_s = poll_s
        self.done_timeout_s = done_timeout_s  # rank 0 may spend 60 s in scontrol: the others wait longer
        self.linger_s = linger_s  # rank 0 leaves this long after "done": the others (polling each second until
        # they see "stopping", then every 0.1 s) leave first
        self.started = time.time()
        self.stopping = threading.Event()  # set before any rank may leave: from here on peers break
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc_train-unasked-stop", daemon=True)

    def __enter__(self) -> UnaskedStop:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def consequence(self, error: BaseException) -> StopConsequence | None:
        """``error``, raised by the program while this attempt stops, as a consequence of the stop (None when
        no stop is under way: then it is the program's own failure). Waits for rank 0's ``done`` notice, whose
        exit status the rank leaves with."""
        notice = read_notice(self.run_dir, self.attempt, self.started, heard_only=False)  # once: the file too
        if notice is None and not self.stopping.is_set():
            return None
        done = wait_for_done(self.run_dir, self.attempt, self.started, self.done_timeout_s)
        return StopConsequence(error, done or notice or StopNotice(
            self.attempt, "done", time.time(), "?", "none", EXIT_STOPPED, "rank 0 published no stop"))

    def returned_meanwhile(self) -> StopNotice | None:
        """The program returned by itself while this attempt stops (a library that ends its loop on the SIGTERM
        of the requeue): the stop's ``done`` notice, which the rank leaves with; None when no stop is under way
        (or the program asked ``should_stop()``: then it stopped by itself, and ``_finish`` records it)."""
        if self._program_asks() or (read_notice(self.run_dir, self.attempt, self.started, heard_only=False) is None
                                    and not self.stopping.is_set()):
            return None
        return wait_for_done(self.run_dir, self.attempt, self.started, self.done_timeout_s)

    def _program_asks(self) -> bool:
        event = self.asked()
        return event is not None and event.is_set()

    def _run(self) -> None:
        deadline: float | None = None
        while not self._done.wait(self.poll_s if deadline is not None else 1.0):
            if self._program_asks():
                return  # the program asks: it stops by itself
            notice = read_notice(self.run_dir, self.attempt, self.started) if self.rank != 0 else None
            if notice is not None:  # rank 0 stops the attempt (whether or not this rank has the signal)
                self.stopping.set()
                self._follow(notice.signal)
                return
            signum = self.watch.received
            if not signum and self.rank == 0 and (name := read_request(self.run_dir, self.attempt, self.started)):
                signum = getattr(signal, name, 0)
                deadline = time.monotonic()  # the rank that asked has waited the grace period already
            if not signum:
                continue
            deadline = deadline or time.monotonic() + self.grace_s
            if time.monotonic() < deadline:
                continue
            if self.rank == 0:
                self._decide(signum)
            else:
                request_stop(self.run_dir, self.attempt, self.rank, signal_name(signum))
                deadline = float("inf")  # asked once; now wait for rank 0's notice
            if self.rank == 0:
                return

    def _say_stopping(self, name: str) -> None:
        self.log(f"{name} received and the program did not ask should_stop() within {self.grace_s:.0f} s: "
                 "stopping it here on every rank; the next attempt starts the program again, which resumes from "
                 "what it saved")

    def _decide(self, signum: int) -> None:
        """Rank 0: decide, publish ``stopping``, requeue and record, publish ``done``, leave with the others."""
        name = signal_name(signum)
        self._say_stopping(name)
        preempt = self.plan.config.preempt
        decision = self.recorder.requeue_decision(name == f"SIG{self.plan.signal}", preempt.requeue,
                                                  preempt.max_requeues)
        step = self.last_step()
        self.stopping.set()
        notice = StopNotice(self.attempt, "stopping", time.time(), name, decision.action, decision.exit_code,
                            decision.reason, step)
        publish_notice(self.run_dir, notice)
        done = self.recorder.record_stop(step, signum, decision, "the program did not ask should_stop(); ")
        publish_notice(self.run_dir, replace(notice, phase="done", time=time.time(), action=done.action,
                                             exit_code=done.exit_code, reason=done.reason))
        self.log(format_stopped(step, name, done.action, done.reason, done.exit_code))
        time.sleep(self.linger_s)
        self._exit(done.exit_code)

    def _follow(self, name: str) -> None:
        """Another rank: leave with the exit status rank 0 published, once it has requeued and recorded."""
        self._say_stopping(name)
        done = wait_for_done(self.run_dir, self.attempt, self.started, self.done_timeout_s)
        if done is None:
            self.log(f"rank 0 published no stop within {self.done_timeout_s:.0f} s; exiting with status "
                     f"{EXIT_STOPPED}")
            self._exit(EXIT_STOPPED)
            return
        self.log(format_stopped(done.step, done.signal, done.action, done.reason, done.exit_code))
        self._exit(done.exit_code)
