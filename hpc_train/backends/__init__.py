"""Where a job's ranks run, one class per backend: Slurm, submitit's local executor, or neither (a plain torchrun
or mpirun). Each owns what differs between them: who the job is, how many times it may start again, and how it
asks for its next attempt. The rest of hpc_train asks a backend, never tests a name or a variable of its own.

Learnt from submitit, whose executors each own their requeue (``SlurmJobEnvironment`` and the local executor's
restart code). Standard library and the run folder's protocol only: the login side names a backend by the
plan's ``executor``, the ranks find theirs in their environment (:func:`backend_of`).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from hpc_train.run.chain import REQUEUE_ENV, submit_successor
from hpc_train.run.exclusions import exclude_expression, read_exclusions
from hpc_train.run.exit_codes import EXIT_STOPPED, LOCAL_REQUEUE_EXIT
from hpc_train.run.jobid import scontrol_job_id

__all__ = ["EXECUTORS", "Backend", "LocalBackend", "NoBackend", "Requeue", "Runner", "SlurmBackend", "backend_of",
           "default_executor", "executor_backend"]

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Requeue:
    """How an attempt ends when it goes on in another: ``scontrol`` (Slurm requeues this job), ``dependency``
    (the next job of a chain), ``local`` (submitit's local executor starts the tasks again) or ``none``; the exit
    status every rank leaves with, and why."""

    action: str
    exit_code: int
    reason: str


class Backend:
    """What every backend answers. ``executor`` is the plan's name for it (``""``: not an executor of ours)."""

    executor: ClassVar[str] = ""
    on_slurm: ClassVar[bool] = False  # a Slurm allocation: sacct, scontrol, ExcNodeList, SLURM_* places
    job_ids: ClassVar[bool] = False  # its attempts have Slurm job ids that status and follow ask Slurm about

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    @property
    def job_id(self) -> str:
        """The id ``scontrol`` acts on for this job alone (an array task's own), or empty."""
        return ""

    def restart_limit(self, max_requeues: int) -> tuple[int, str]:
        """How many times this job may start again, and why that many."""
        return max_requeues, f"preempt.max_requeues = {max_requeues}"

    def next_attempt(self) -> Requeue:
        """What would start the next attempt (decided; :meth:`requeue` carries it out)."""
        return Requeue("none", EXIT_STOPPED, "not under Slurm or submitit; run the same command again to resume")

    def requeue(self, decision: Requeue, run_dir: Path | None, run: Runner = subprocess.run) -> Requeue:
        """Carry out ``decision``; a failure becomes ``none`` with why."""
        return decision


class NoBackend(Backend):
    """A plain torchrun, mpirun or python: nothing can start the job again but its user."""


class LocalBackend(Backend):
    """submitit's local executor: its controller starts the tasks again on exit status 144, at most 5 times."""

    executor = "local"
    MAX_RESTARTS: ClassVar[int] = 5  # its controller's max_retry is 6 starts

    def restart_limit(self, max_requeues: int) -> tuple[int, str]:
        if max_requeues <= self.MAX_RESTARTS:
            return super().restart_limit(max_requeues)
        return self.MAX_RESTARTS, f"submitit's local executor restarts a job at most {self.MAX_RESTARTS} times"

    def next_attempt(self) -> Requeue:
        return Requeue("local", LOCAL_REQUEUE_EXIT, "submitit's local executor restarts the tasks")


class SlurmBackend(Backend):
    """A Slurm job: ``scontrol requeue`` of this job, or where the site forbids requeue (``[slurm] requeue =
    "dependency"``) the next job of a chain after it."""

    executor = "slurm"
    on_slurm = True
    job_ids = True

    def __init__(self, env: Mapping[str, str], job_id: str | None = None) -> None:
        super().__init__(env)
        self._job_id = job_id  # a job read from the run folder; None: this process's own

    @property
    def job_id(self) -> str:
        return scontrol_job_id(self.env, self._job_id)

    @property
    def chained(self) -> bool:
        return self.env.get(REQUEUE_ENV) == "dependency"

    def next_attempt(self) -> Requeue:
        if not self.chained:
            return Requeue("scontrol", 0, f"scontrol requeue {self.job_id}")
        if self.env.get("SLURM_ARRAY_TASK_ID"):
            return Requeue("none", EXIT_STOPPED, "a sweep's array task cannot go on as a new job ([slurm] requeue "
                                                 "= \"dependency\"); submit the sweep again to resume")
        return Requeue("dependency", 0, "a new job after this one ([slurm] requeue = \"dependency\")")

    def requeue(self, decision: Requeue, run_dir: Path | None, run: Runner = subprocess.run) -> Requeue:
        if decision.action == "dependency":
            return self._chain(decision, run_dir, run)
        if decision.action == "scontrol":
            return self._scontrol(decision, run)
        return decision

    def _chain(self, decision: Requeue, run_dir: Path | None, run: Runner) -> Requeue:
        if run_dir is None:
            return Requeue("none", EXIT_STOPPED, "no run folder to chain the next job into; resubmit to resume")
        exclude = exclude_expression(read_exclusions(run_dir))
        own = self._job_id or self.env.get("SLURM_JOB_ID", "")
        successor, said = submit_successor(run_dir, own, self.env, run, exclude=exclude)
        return Requeue("dependency", decision.exit_code, said) if successor else Requeue("none", EXIT_STOPPED, said)

    def _scontrol(self, decision: Requeue, run: Runner) -> Requeue:
        job_id = self.job_id
        if shutil.which("scontrol") is None:
            return Requeue("none", EXIT_STOPPED, "scontrol is not on PATH on the node, so the job cannot requeue "
                                                 "itself; resubmit to resume")
        try:
            result = run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60, check=False)
        except subprocess.TimeoutExpired:
            return Requeue("none", EXIT_STOPPED, f"scontrol requeue {job_id} did not answer within 60 s")
        except OSError as error:
            return Requeue("none", EXIT_STOPPED, f"scontrol requeue {job_id} could not start: {error.strerror}")
        if result.returncode < 0:
            # scontrol runs inside the job's step, so the requeue it asked for ends it too: killed by a signal with
            # nothing said means Slurm is requeuing (seen under load: "STEP CANCELLED DUE TO JOB REQUEUE").
            return decision
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            return Requeue("none", EXIT_STOPPED, f"scontrol requeue {job_id} failed: {detail[-1] if detail else ''}")
        return decision


EXECUTORS: dict[str, type[Backend]] = {"slurm": SlurmBackend, "local": LocalBackend}


def backend_of(env: Mapping[str, str]) -> Backend:
    """The backend this process runs under: submitit's local executor says so (``SUBMITIT_EXECUTOR``), and it
    may run inside a Slurm allocation, so it is asked first; then Slurm's job id."""
    if env.get("SUBMITIT_EXECUTOR") == LocalBackend.executor:
        return LocalBackend(env)
    if env.get("SLURM_JOB_ID"):
        return SlurmBackend(env)
    return NoBackend(env)


def default_executor(slurm_enabled: bool) -> str:
    """The executor ``--executor auto`` means: Slurm on a site with Slurm, else the local one."""
    return (SlurmBackend if slurm_enabled else LocalBackend).executor


def executor_backend(executor: str) -> type[Backend]:
    """The backend a plan's ``executor`` names (``slurm`` or ``local``); any other name (a run folder of
    another version) is a backend with neither Slurm nor a restart."""
    return EXECUTORS.get(executor, NoBackend)
