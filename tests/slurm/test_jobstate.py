"""Job state from one batched sacct call per poll, on real jobs of the local cluster."""

from __future__ import annotations

import itertools
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from hpc_train.login.slurm import jobstate
from hpc_train.login.slurm.follow import FollowedJob, follow

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


@dataclass
class SbatchJob:
    """A job submitted with plain sbatch: what the follower needs of a job."""

    job_id: str

    def cancel(self, check: bool = False) -> None:
        subprocess.run(["scancel", self.job_id], check=check)


def _sbatch(seconds: int, exit_code: int = 0) -> SbatchJob:
    out = subprocess.run(["sbatch", "--parsable", "-N1", "-n1", "-o", "/dev/null",
                          f"--wrap=sleep {seconds}; exit {exit_code}"], capture_output=True, text=True, check=True)
    return SbatchJob(out.stdout.strip().split(";")[0])


def test_one_sacct_call_per_poll_for_all_jobs_with_backoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, list[str]]] = []
    real_run = jobstate._run

    def counting_run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        if argv[0] == "sacct":
            calls.append((time.monotonic(), argv))
        return real_run(argv)

    monkeypatch.setattr(jobstate, "_run", counting_run)
    jobs = [_sbatch(6), _sbatch(6), _sbatch(1, exit_code=3)]
    for index in range(len(jobs)):
        (tmp_path / str(index) / "logs").mkdir(parents=True)
    followed = [FollowedJob(job, tmp_path / str(i)) for i, job in enumerate(jobs)]
    with open(tmp_path / "out.txt", "w") as out:
        code = follow(followed, "slurm", Console(file=out), max_poll_s=2.0)
    assert code == 1  # the third job exits 3
    assert [job.state for job in followed] == ["COMPLETED", "COMPLETED", "FAILED"]
    ids = {job.job_id for job in jobs}
    first_jobs = calls[0][1][calls[0][1].index("--jobs") + 1].split(",")
    assert set(first_jobs) == ids  # one call covered every job
    for _, argv in calls:
        assert argv.count("--jobs") == 1
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(calls)]
    assert max(gaps) > 1.2 * min(gaps)  # the interval backs off while nothing changes
    assert len(calls) < 6 * 4  # far fewer calls than one per job per 0.5 s


def test_query_states_reads_array_tasks_and_refuses_odd_ids() -> None:
    with pytest.raises(ValueError, match="not a Slurm job id"):
        jobstate.query_states(["1;rm -rf /"])
    job = _sbatch(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = jobstate.query_states([job.job_id]).get(job.job_id)
        if state and state.done:
            break
        time.sleep(0.5)
    assert state is not None and state.state == "COMPLETED" and state.exit_code == "0:0"
