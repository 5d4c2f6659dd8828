"""Job state from Slurm: one ``sacct`` call per poll for every job being followed, never one per job.

Also the pre-flight check that Slurm can be reached and keeps accounting (without accounting a job that dies
without a result can never be resolved, and submitit's ``result()`` then hangs).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from hpc_train.errors import ConfigError

__all__ = ["FINAL_STATES", "JobState", "SlurmQueryError", "check_slurm_available", "query_states"]

FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE"})
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
_TIMEOUT_S = 20


class SlurmQueryError(RuntimeError):
    """sacct failed at run time (the controller or database went away while following a job)."""


@dataclass(frozen=True)
class JobState:
    """One job (or array task) as sacct reports it."""

    job_id: str
    state: str
    exit_code: str
    nodes: str
    reason: str

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)


def query_states(job_ids: list[str]) -> dict[str, JobState]:
    """States of all ``job_ids`` from one sacct call; jobs sacct does not know yet are left out."""
    for job_id in job_ids:
        if not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"not a Slurm job id: {job_id!r}")
    if not job_ids:
        return {}
    try:
        result = _run(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", ",".join(job_ids),
                       "--format=JobID,State,ExitCode,NodeList,Reason"])
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SlurmQueryError(f"sacct failed: {error}") from None
    if result.returncode != 0:
        raise SlurmQueryError(f"sacct failed: {result.stderr.strip() or result.stdout.strip()}")
    states: dict[str, JobState] = {}
    for line in result.stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 5:
            continue
        job_id, state, exit_code, nodes, reason = parts[:5]
        # "CANCELLED by 0" -> CANCELLED; a requeued job shows one line per attempt: the last one wins.
        states[job_id] = JobState(job_id, state.split()[0] if state else "UNKNOWN", exit_code, nodes, reason)
    return states


def check_slurm_available() -> None:
    """Exit-2 errors (nothing submitted) when the controller is unreachable or accounting is off."""
    try:
        ping = _run(["scontrol", "ping"])
    except FileNotFoundError:
        raise ConfigError("--executor", "slurm, but scontrol is not on PATH",
                          "run on a Slurm login node, or use --executor local") from None
    except subprocess.TimeoutExpired:
        ping = subprocess.CompletedProcess([], 1, "", "scontrol ping timed out")
    if ping.returncode != 0 or " is UP" not in ping.stdout:
        detail = (ping.stderr or ping.stdout).strip().splitlines()
        raise ConfigError("slurm", "the Slurm controller cannot be reached" + (f" ({detail[-1]})" if detail else ""),
                          "check 'scontrol ping' and SLURM_CONF, or use --executor local")
    try:
        acct = _run(["sacct", "--noheader", "--allocations", "--jobs", "1", "--format=JobID"])
    except (OSError, subprocess.TimeoutExpired) as error:
        acct = subprocess.CompletedProcess([], 1, "", str(error))
    if acct.returncode != 0 or "accounting storage is disabled" in (acct.stderr + acct.stdout).lower():
        detail = (acct.stderr or acct.stdout).strip().splitlines()
        raise ConfigError("slurm", "job accounting (sacct) is not available" + (f" ({detail[-1]})" if detail else ""),
                          "hpc_train needs sacct to follow jobs: ask your admins to enable slurmdbd accounting, or "
                          "submit with --no-follow")
