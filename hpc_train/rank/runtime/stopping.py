"""How an attempt ends, as every rank sees it: the record in ``attempts.jsonl`` (rank 0 writes it) and, after a
preemption signal, the requeue decision rank 0 makes and broadcasts so that all ranks leave with the same
exit status."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train.failures.policy import RetryPolicy
from hpc_train.rank.distributed.collectives import broadcast_object
from hpc_train.rank.distributed.launchers import LaunchInfo
from hpc_train.rank.runtime.preemption import Requeue, decide_requeue, perform_requeue
from hpc_train.rank.runtime.watchdog import Hang
from hpc_train.run.attempts import Attempt, AttemptLog, recommended_lead_seconds, requeues_so_far
from hpc_train.run.chain import REQUEUE_ENV, jobs_before, links_before
from hpc_train.run.exit_codes import EXIT_HUNG, EXIT_RESTART_IN_PLACE
from hpc_train.run.in_place import RestartNotice, in_place_left, request_restart
from hpc_train.run.node import node_name
from hpc_train.run.stops import attempt_key

__all__ = ["AttemptRecorder", "decide_hang", "signal_name"]


def signal_name(number: int) -> str:
    return signal.Signals(number).name


class AttemptRecorder:
    """Times steps and saves, and keeps this attempt's line in ``attempts.jsonl``; a no-op on ranks other than 0
    except for the collectives, which every rank must join."""

    def __init__(self, run_dir: Path, info: LaunchInfo, start_step: int, lead_seconds: int,
                 log: Callable[[str], None]) -> None:
        self.is_writer = info.rank == 0
        self.lead_seconds = lead_seconds
        self.log = log
        self.step_s_max: float | None = None
        self.save_s_max: float | None = None
        self._warned = False
        self.attempts = AttemptLog(run_dir)
        self.current: Attempt | None = None
        if self.is_writer:
            self.current = self.attempts.begin(job_id=info.job_id or "", restart=info.restart,
                                               host=node_name(), started=time.time(), start_step=start_step,
                                               in_place=info.in_place)

    def step_time(self, seconds: float) -> None:
        self.step_s_max = max(self.step_s_max or 0.0, seconds)

    def save_time(self, seconds: float) -> None:
        """Record a save and say once when a step plus a save no longer fit in the signal's lead time."""
        self.save_s_max = max(self.save_s_max or 0.0, seconds)
        if not self.is_writer or self._warned or self.current is None:
            return
        measured = Attempt(**{**self.current.__dict__, "step_s_max": self.step_s_max,
                                 "save_s_max": self.save_s_max})
        needed = recommended_lead_seconds([measured], floor=0)
        if needed > self.lead_seconds:
            self._warned = True
            self.log(f"warning: a step ({self.step_s_max or 0:.1f} s) and a save ({self.save_s_max:.1f} s) need "
                     f"about {needed} s after a preemption signal, but the signal comes {self.lead_seconds} s "
                     f"ahead; raise preempt.lead_seconds to {needed} (the next submission of this run folder "
                     "uses the measured value by itself)")

    def _finish(self, **changes: Any) -> None:
        if self.current is not None:
            self.current = self.attempts.finish(self.current, ended=time.time(), step_s_max=self.step_s_max,
                                                save_s_max=self.save_s_max, **changes)

    def resumed(self, step: int) -> None:
        """A user program loaded its checkpoint of ``step`` after the attempt was opened: the attempt starts there."""
        if self.current is not None:
            self.current = self.attempts.finish(self.current, start_step=step)

    def requeue_decision(self, requeue_signal: bool, requeue_enabled: bool, max_requeues: int) -> Requeue:
        """Rank 0, no collective: whether this job may requeue now (its requeues so far from attempts.jsonl)."""
        job = self.current.job_id if self.current else None
        env = dict(os.environ)
        before = links_before(self.attempts.path.parent, job or "") if env.get(REQUEUE_ENV) == "dependency" else \
            requeues_so_far(self.attempts.read(), job)  # a chain's jobs each start at restart 0
        return decide_requeue(env, requeue_enabled, max_requeues, before, requeue_signal)

    def decide_stop(self, signum: int, requeue_signal: bool, requeue_enabled: bool, max_requeues: int) -> Requeue:
        """Collective, when the ranks agreed on a signal: rank 0 decides whether the job will requeue and every
        rank gets the same decision (carried out later by :meth:`record_stop`, once the program has saved)."""
        decision = self.requeue_decision(requeue_signal, requeue_enabled, max_requeues) if self.is_writer else None
        return broadcast_object(decision, src=0)

    def record_stop(self, step: int | None, signum: int, decision: Requeue, why: str = "") -> Requeue:
        """Rank 0 carries out ``decision`` (``scontrol requeue``) and records the attempt as preempted; no
        collective, so it works after the program has left its process group. Returns what was done."""
        if not self.is_writer:
            return decision
        done = perform_requeue(decision, dict(os.environ), run_dir=self.attempts.path.parent)
        self._finish(outcome="preempted", end_step=step, signal=signal_name(signum), requeued=done.action != "none",
                     note=f"{why}{done.reason}"[:500])
        return done

    def completed(self, step: int | None) -> None:
        self._finish(outcome="completed", end_step=step)

    def failed(self, step: int | None, error: BaseException) -> None:
        """The attempt failed, unless it had already ended: what a rank raises after its attempt was recorded
        as stopped or requeued is a consequence of that (its peers left), never the attempt's cause."""
        if self.current is not None and self.current.outcome != "running":
            self.log(f"after the attempt ended ({self.current.outcome}): {error!r} (a consequence, not a failure)")
            return
        self._finish(outcome="failed", end_step=step, note=repr(error)[:500])

    def stopped(self, step: int, signum: int, requeue_signal: bool, requeue_enabled: bool,
                max_requeues: int) -> Requeue:
        """After the save that followed a signal: rank 0 records the attempt, requeues if it may, and tells every
        rank what it did."""
        decision = None
        if self.is_writer:
            decision = self.record_stop(step, signum, self.requeue_decision(requeue_signal, requeue_enabled,
                                                                            max_requeues))
        return broadcast_object(decision, src=0)


def decide_hang(run_dir: Path, info: LaunchInfo, recorder: AttemptRecorder | None, hang: Hang, policy: RetryPolicy,
                log: Callable[[str], None]) -> tuple[int, str]:
    """Rank 0, from the watchdog thread: record the attempt as ``hang`` and requeue while the retry policy
    allows (``[retry] hang``, counted per job, or per chain of jobs where requeue is forbidden: a new submission
    starts again). Returns the exit status and why.

    No collectives here: the other ranks are stuck, or waiting for this decision in a file."""
    attempts = AttemptLog(run_dir)
    current = recorder.current if recorder is not None else None
    if current is None:  # hung before the trainer had opened the attempt (bootstrap, model, resume)
        current = attempts.begin(job_id=info.job_id or "", restart=info.restart, host=node_name(),
                                 started=time.time(), start_step=hang.step, in_place=info.in_place)
    # retry.hang counts requeues: a hang restarted in place (retry.in_place) is not one
    env, retries = dict(os.environ), policy.limit("hang")
    jobs = {current.job_id, *(jobs_before(run_dir, current.job_id) if env.get(REQUEUE_ENV) == "dependency" else ())}
    hangs = sum(1 for a in attempts.read() if a.outcome == "hang" and a.requeued and a.job_id in jobs)
    in_place = in_place_left(env) > 0  # an agent starts every rank again inside this job: no requeue
    if in_place:
        decision = Requeue("none", EXIT_RESTART_IN_PLACE, f"restarting in place ({info.in_place + 1} of "
                                                          f"{info.in_place + in_place_left(env)}, retry.in_place)")
    elif hangs >= retries:
        decision = Requeue("none", EXIT_HUNG, f"not requeued: {hangs} earlier hang(s) of this job, retry.hang = "
                                              f"{retries}")
    else:
        decision = perform_requeue(decide_requeue(env, True, retries, hangs), env, run_dir=run_dir)
        if decision.action == "none":
            decision = Requeue("none", EXIT_HUNG, decision.reason)
        elif decision.action in ("scontrol", "dependency"):
            decision = Requeue(decision.action, EXIT_HUNG, f"requeued (hang {hangs + 1} of retry.hang = {retries}): "
                                                           f"{decision.reason}")
    finished = attempts.finish(current, outcome="hang", ended=time.time(), end_step=hang.step,
                               requeued=decision.action != "none", note=f"{hang.describe()}; {decision.reason}"[:500])
    if recorder is not None:  # what the main thread raises next (a warm restart's broken collective) is a consequence
        recorder.current = finished
    log(f"hang: {decision.reason}")
    if in_place:  # last: the agents end every rank once they see it
        request_restart(run_dir, attempt_key(info.job_id, info.restart), RestartNotice(
            info.in_place + 1, info.rank, node_name(), "hang", hang.describe()[:300], time.time()))
    return decision.exit_code, decision.reason
