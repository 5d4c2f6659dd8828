"""``hpc_train.Job``: one submitted run, followed as the command line follows it, with submitit's methods.

``wait()`` is the command's follower (requeues, chains, a failed rank's job cancelled) without its output unless
asked; ``result()`` is rank 0's return value, or ``JobFailed`` with the failure's class and reason as
``hpc_train status`` names them.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_train.backends import executor_backend
from hpc_train.errors import ConfigError
from hpc_train.run.attempts import Attempt, AttemptLog

if TYPE_CHECKING:
    from hpc_train.login.slurm.follow import FollowedJob
    from hpc_train.login.submit import Submitted

__all__ = ["Job", "JobFailed"]

_SETTLING = {"COMPLETING", "RUNNING", "PENDING", "CONFIGURING"}
_SETTLE_S = 60.0


class JobFailed(RuntimeError):  # noqa: N818 - the name the API promises, beside submitit's FailedJobError
    """The job did not complete: ``failure_class`` as ``hpc_train status`` classifies it (``user_error``,
    ``out_of_memory``, ``hang``, ``cancelled``, ...), ``reason`` its one line, and where to look."""

    def __init__(self, job_id: str, run_dir: Path, failure_class: str, reason: str) -> None:
        super().__init__(f"job {job_id}: {reason} (run folder {run_dir}; hpc_train status "
                         f"{run_dir} and hpc_train logs {run_dir} say more)")
        self.job_id, self.run_dir, self.failure_class, self.reason = job_id, run_dir, failure_class, reason


class Job:
    """A submitted run: ``job_id``, ``run_dir``, ``state``, ``attempts``, ``done()``, ``wait()``, ``result()``,
    ``cancel()``."""

    def __init__(self, submitted: Submitted) -> None:
        self._followed: FollowedJob = submitted.followed()
        self._executor = submitted.plan.executor
        self.run_dir: Path = submitted.run_dir
        self._ended: int | None = None  # the follower's verdict once the job ended: 0 completed, else 1
        self._report = ""

    @property
    def job_id(self) -> str:
        """The Slurm job (or local process) now carrying the run: a chain's newest job after a requeue."""
        return self._followed.job_id

    @property
    def state(self) -> str:
        """The scheduler's state now (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...; local: RUNNING,
        COMPLETED or FAILED), asked once per read."""
        if self._ended is None:
            from hpc_train.login.slurm.follow import poll, take_successor

            poll([self._followed], self._executor)
            take_successor(self._followed)  # the run went on in the next job of its chain: that one is followed now
        return self._followed.state

    @property
    def attempts(self) -> list[Attempt]:
        """Every attempt of the run so far (requeues and restarts inside the job), from ``attempts.jsonl``."""
        return AttemptLog(self.run_dir).read()

    def done(self) -> bool:
        """Whether the job has ended (a job Slurm is requeueing has not)."""
        if self._ended is None:
            _ = self.state
        return self._ended is not None or self._followed.done

    def wait(self, show: bool = False) -> bool:
        """Follow the job to its end (``show``: its rank-0 log and states, as ``submit`` prints them); True when
        it completed. A rank's failure ends the job as the command's follower ends it."""
        if self._ended is None:
            from rich.console import Console

            from hpc_train.login.slurm.follow import follow

            buffer = io.StringIO()
            console = Console(soft_wrap=True) if show else Console(file=buffer, soft_wrap=True, width=200)
            on_slurm = executor_backend(self._executor).on_slurm
            # one job's sacct every 2 s at most (submit's follower backs off to 5 s): result() comes soon after
            self._ended = follow([self._followed], self._executor, console, max_poll_s=2.0 if on_slurm else 1.0)
            self._report = buffer.getvalue()
        return self._ended == 0

    def result(self) -> Any:
        """Wait, then rank 0's return value; ``JobFailed`` when the job did not complete or kept no value."""
        from hpc_train.run.pickled import read_value

        if not self.wait():
            raise self._failure()
        try:
            kept = read_value(self.run_dir)
        except Exception as error:  # unpickling can raise anything: a torch tensor on a login node without torch
            raise JobFailed(self.job_id, self.run_dir, "no_result", f"the job completed but its return value "
                            f"cannot be read here ({type(error).__name__}: {error}); return plain values (numbers, "
                            "strings, lists, dicts, CPU tensors where torch is installed)") from None
        if kept.problem:
            raise JobFailed(self.job_id, self.run_dir, "no_result", kept.problem)
        return kept.value

    def cancel(self) -> None:
        """End the job now (Slurm: scancel of the job carrying the run; local: its processes), recorded in the
        run folder as the user's cancel, which ``status`` and ``JobFailed`` name."""
        from hpc_train.login.ops.cancel import cancel_local, cancel_run

        if self.done():
            return  # nothing left to end, as submitit's cancel of an ended job
        if not executor_backend(self._executor).on_slurm:
            cancel_local(self.run_dir, int(self.job_id), "Job.cancel()")  # checks the pid is still its controller
            return
        cancel_run(self.run_dir, "Job.cancel()")  # the job carrying the run now, as hpc_train cancel finds it

    def _failure(self) -> JobFailed:
        """The failure as ``status`` classifies it; the follower's own words where it cannot."""
        from hpc_train.login.ops.status import collect

        found = None
        deadline = time.monotonic() + _SETTLE_S
        while True:  # the follower saw the job end; accounting may still say COMPLETING for a moment
            try:
                found = collect([self.run_dir])[0][0]
            except (ConfigError, OSError):
                break
            if found.state.split()[0].upper() not in _SETTLING or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if found is not None and found.failure is not None:
            return JobFailed(self.job_id, self.run_dir, found.failure.failure_class, found.failure.reason)
        lines = [line for line in self._report.splitlines() if line.strip()]
        said = next((line for line in lines if " failed" in line or " hung" in line or " stopped" in line), "")
        state = found.state if found is not None else self._followed.state
        return JobFailed(self.job_id, self.run_dir, state.lower() or "failed", said or f"ended {state}")

    def __repr__(self) -> str:
        return f"Job<{self.job_id}, {self.run_dir.name}>"

