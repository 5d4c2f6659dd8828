"""Run a user program on this rank: a function called with the run context, or a script run as ``__main__``.

A function is imported before anything starts (an import error fails in a second, naming the module), then
called after the bootstrap with the context. A script gets the torchrun variables, ``sys.argv`` from
``job.args`` and no process group, so ``dist.init_process_group()`` works in it unchanged. Either way the
attempt ends completed (a normal return), stopped (a return after ``should_stop()`` said True: recorded and
requeued) or failed (an exception, or a script's non-zero exit: a user error, not requeued).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train.config.plan import Plan
from hpc_train.config.program import API_PROGRAM, Program, parse_program
from hpc_train.failures.policy import RetryPolicy
from hpc_train.rank.distributed.bootstrap import shutdown
from hpc_train.rank.distributed.launchers import LaunchInfo
from hpc_train.rank.distributed.rendezvous import check_resolves, choose_rendezvous, export_rendezvous
from hpc_train.rank.program.context import RunContext, Session, context, open_session
from hpc_train.rank.program.stop import UnaskedStop
from hpc_train.rank.runtime.entry_points import UserCodeError, load_callable
from hpc_train.rank.runtime.monitor import LogLines
from hpc_train.rank.runtime.preemption import PreemptionWatch, Requeue
from hpc_train.rank.runtime.stopping import AttemptRecorder, decide_hang, signal_name
from hpc_train.rank.runtime.watchdog import Timeouts, Watchdog
from hpc_train.run.pickled import write_value
from hpc_train.run.stops import StopNotice, attempt_key, publish_notice, wait_for_done

__all__ = ["UserCodeError", "run_program"]


def load_function(program: Program) -> Callable[[Any], Any]:
    """The user's function, checked to take ``ctx``; UserCodeError naming the entry point otherwise."""
    return load_callable("job.program", program, ("ctx",))


class _LazyWatchdog:
    """The hang watchdog, started on first use: at once for a function, at a script's first
    ``hpc_train.context()`` (a script that never asks for its context is not watched)."""

    def __init__(self, plan: Plan, info: LaunchInfo, run_dir: Path, recorder: AttemptRecorder,
                 log: Callable[[str], None]) -> None:
        self.plan, self.info, self.run_dir, self.recorder, self.log = plan, info, run_dir, recorder, log
        self.watchdog: Watchdog | None = None

    def _decide(self, hang: Any) -> tuple[int, str]:
        policy = RetryPolicy.from_section(self.plan.config.retry)
        return decide_hang(self.run_dir, self.info, self.recorder, hang, policy, self.log)

    def start(self) -> Watchdog | None:
        wcfg, info = self.plan.config.watchdog, self.info
        if wcfg.enabled and self.watchdog is None:
            key = attempt_key(info.job_id, info.restart, info.in_place)
            self.watchdog = Watchdog(self.run_dir, info.rank, info.world_size, key,
                                     Timeouts(wcfg.startup_timeout_s, wcfg.step_timeout_s, wcfg.checkpoint_timeout_s),
                                     self._decide if info.rank == 0 else None, self.log).__enter__()
        return self.watchdog

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.__exit__(None, None, None)


def _export_torchrun_env(plan: Plan, info: LaunchInfo) -> None:
    """What torchrun gives a script: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_*."""
    rendezvous = choose_rendezvous(info, (plan.port_range[0], plan.port_range[1]), plan.fabric_suffix)
    check_resolves(rendezvous.addr)
    export_rendezvous(info, rendezvous)
    os.environ.update(GROUP_RANK=str(info.node_rank), ROLE_RANK=str(info.rank), ROLE_WORLD_SIZE=str(info.world_size))


def _exited(exit: SystemExit, what: str) -> None:
    """``sys.exit()`` in a program: 0 or None is a normal end, anything else a UserCodeError."""
    if exit.code not in (0, None):
        raise UserCodeError(f"{what} exited with status {exit.code}") from None


def _call(function: Callable[[Any], Any], program: Program) -> Any:
    try:
        return function(context())
    except SystemExit as exit:
        _exited(exit, f"function {program.text()}")
    return None


def _run_script(plan: Plan, info: LaunchInfo, program: Program) -> None:
    """The script as ``__main__`` with ``sys.argv = [script, *job.args]``; a non-zero exit is a UserCodeError."""
    _export_torchrun_env(plan, info)
    argv, folder = sys.argv, str(Path(program.path).parent)
    sys.argv = [program.path, *plan.config.job.args]
    sys.path.insert(0, folder)  # as ``python script.py`` would
    try:
        runpy.run_path(program.path, run_name="__main__")
    except SystemExit as exit:
        _exited(exit, f"script {program.path}")
    finally:
        sys.argv = argv
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def run_program(plan: Plan, info: LaunchInfo, run_dir: Path, log: Callable[[str], None],
                watch: PreemptionWatch) -> dict[str, Any]:
    """Run the plan's user program on this rank; return this rank's result (``stopped`` after a signal)."""
    program = parse_program(plan.config.job.program)
    if plan.code_dir and plan.code_dir not in sys.path:
        sys.path.insert(0, plan.code_dir)
    recorder = AttemptRecorder(run_dir, info, 0, plan.lead_seconds, log)
    try:
        function = load_function(program) if program.kind != "script" else None
    except UserCodeError as error:
        recorder.failed(0, error)
        raise
    watchdog = _LazyWatchdog(plan, info, run_dir, recorder, log)
    session = Session(plan, info, run_dir, log, watch, recorder, watchdog.start)
    if function is not None:
        watchdog.start()
    open_session(session)

    def asked() -> Any:
        return session.context.stop.asked if session.context else None

    def last_step() -> int | None:
        """The program's step, None where it never said (a script without ``ctx.log`` or an integration)."""
        ctx = session.context
        return ctx.step if ctx is not None and ctx.step_known else None

    unasked = UnaskedStop(plan, info.rank, watch, recorder, asked, last_step, log, run_dir,
                          attempt_key(info.job_id, info.restart, info.in_place))
    try:
        # The program's prints go to its rank's log (rank 0's is what the login node follows), line by line.
        with unasked, contextlib.redirect_stdout(LogLines(log)):
            value = None
            if function is None:
                _run_script(plan, info, program)
            else:
                value = _call(function, program)
            notice = unasked.returned_meanwhile()
        if notice is not None:  # rank 0 stopped the attempt: leave with it, never as completed
            return _stopped_meanwhile(session, program, notice)
        return _finish(session, program, value)
    except BaseException as error:
        consequence = unasked.consequence(error)
        if consequence is not None:
            raise consequence from error
        recorder.failed(last_step(), error)
        raise
    finally:
        if session.context is not None:
            session.context.close()
        watchdog.stop()
        if session.owns_group:
            shutdown()
        open_session(None)


def _record_asked_stop(session: Session, step: int | None, signum: int, decision: Requeue) -> Requeue:
    """Rank 0 requeues and records, then publishes the stop's ``done`` notice; the other ranks leave only once
    it is there (no collective: the program may have destroyed its process group), so none ends the job under
    rank 0 (srun's --kill-on-bad-exit) before the attempt is recorded."""
    info, run_dir = session.info, session.run_dir
    key = attempt_key(info.job_id, info.restart, info.in_place)
    if info.rank == 0:
        done = session.recorder.record_stop(step, signum, decision)
        publish_notice(run_dir, StopNotice(key, "done", time.time(), signal_name(signum), done.action,
                                           done.exit_code, done.reason, step))
        return done
    notice = wait_for_done(run_dir, key, session.started, timeout_s=90)
    return Requeue(notice.action, notice.exit_code, notice.reason) if notice is not None else decision


def _stopped_meanwhile(session: Session, program: Program, notice: StopNotice) -> dict[str, Any]:
    """This rank's result when the program returned while rank 0 stopped the attempt (rank 0 recorded it)."""
    info = session.info
    return {"rank": info.rank, "program": program.text(), "world_size": info.world_size, "launcher": info.launcher,
            "step": notice.step, "stopped": {"signal": notice.signal, "step": notice.step, "requeue": notice.action,
                                             "exit_code": notice.exit_code, "reason": notice.reason}}


def _finish(session: Session, program: Program, value: Any = None) -> dict[str, Any]:
    """Completed, or stopped after ``should_stop()`` said True (rank 0 records and requeues). Rank 0 keeps the
    return value of ``Executor.submit``'s function (``Job.result()``) before the attempt is recorded completed."""
    ctx: RunContext | None = session.context
    info = session.info
    step = ctx.step if ctx is not None and ctx.step_known else None
    result: dict[str, Any] = {"rank": info.rank, "program": program.text(), "world_size": info.world_size,
                              "launcher": info.launcher, "step": step}
    if ctx is not None:
        ctx.checkpoint.finish()  # collective: a background save is committed before the attempt ends
    if ctx is not None and ctx.stop.decision is not None:
        ctx.stop.settle()
        done = _record_asked_stop(session, step, ctx.stop.signum, ctx.stop.decision)
        result["stopped"] = {"signal": signal_name(ctx.stop.signum), "step": step, "requeue": done.action,
                             "exit_code": done.exit_code, "reason": done.reason}
        return result
    if info.rank == 0 and program.text() == API_PROGRAM:
        kept = write_value(session.run_dir, value)
        if kept.problem:
            session.log(f"warning: {kept.problem}; Job.result() raises JobFailed")
    session.recorder.completed(step)
    return result
