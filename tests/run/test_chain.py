"""A dependency chain of jobs as one run (``[slurm] requeue = "dependency"``): the links rank 0 records, the
chain and the requeues so far read back from them, what the next job does not inherit, and a next job that
cannot be submitted. The whole path on the local cluster is tests/slurm/test_preemption_e2e.py's
``test_where_requeue_is_forbidden_a_preempted_job_goes_on_as_a_new_job``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_train.run.chain import (
    _job_environment,
    chain_of,
    jobs_before,
    links_before,
    record_successor,
    submit_successor,
    successor_of,
)


def test_the_links_read_back_as_one_chain(tmp_path: Path) -> None:
    record_successor(tmp_path, "10", "11")
    record_successor(tmp_path, "11", "15")
    assert successor_of(tmp_path, "10") == "11" and successor_of(tmp_path, "15") is None
    assert chain_of(tmp_path, "10") == ["10", "11", "15"]
    assert [links_before(tmp_path, job) for job in ("10", "11", "15", "99")] == [0, 1, 2, 0]
    assert jobs_before(tmp_path, "15") == ["11", "10"]  # retry.hang counts the chain's hangs, not one job's
    assert oct((tmp_path / "chain").stat().st_mode & 0o777) == "0o700"


def test_a_link_that_loops_or_is_not_a_job_id_ends_the_chain(tmp_path: Path) -> None:
    record_successor(tmp_path, "1", "2")
    record_successor(tmp_path, "2", "1")
    assert chain_of(tmp_path, "1") == ["1", "2"]
    (tmp_path / "chain" / "3.json").write_text('{"job": "3", "successor": "3; rm -rf /"}')
    assert successor_of(tmp_path, "3") is None


def test_the_next_job_does_not_inherit_this_jobs_slurm_launcher_or_rank() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/root", "WANDB_PROJECT": "p", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2",
           "SBATCH_PARTITION": "x", "RANK": "0", "MASTER_PORT": "29500", "HPC_TRAIN_IN_PLACE": "1",
           "HPC_TRAIN_SHRUNK_NODES": "1",
           "TORCHELASTIC_RUN_ID": "x", "OMPI_COMM_WORLD_RANK": "0", "HPC_TRAIN_REQUEUE": "dependency"}
    assert _job_environment(env) == {"PATH": "/usr/bin", "HOME": "/root", "WANDB_PROJECT": "p",
                                     "HPC_TRAIN_REQUEUE": "dependency"}


def _fake(tmp_path: Path, name: str, body: str) -> None:
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n" + body)
    (folder / name).chmod(0o755)


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scontrol that writes a batch script and an sbatch that records its arguments (the real pair runs in
    the Slurm end-to-end test; these show what is passed and what a failure says)."""
    _fake(tmp_path, "scontrol", 'printf "#!/bin/bash\\n#SBATCH --nodes=2\\nsrun true\\n"\n')
    _fake(tmp_path, "sbatch", f'echo "$@" > {tmp_path}/sbatch-args\necho "58;cluster"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    return tmp_path


def test_the_script_is_submitted_again_after_this_job_and_submitits_pickle_follows(fake_slurm: Path) -> None:
    run_dir = fake_slurm / "run"
    (run_dir / "submitit").mkdir(parents=True)
    (run_dir / "submitit" / "57_submitted.pkl").write_bytes(b"pickled job")
    successor, said = submit_successor(run_dir, "57", {"PATH": os.environ["PATH"]}, exclude="n3")
    assert successor == "58" and said == "submitted job 58 to go on after job 57 (--dependency=afterany:57)"
    args = (fake_slurm / "sbatch-args").read_text().split()
    assert args == ["--parsable", "--dependency=afterany:57", "--kill-on-invalid-dep=yes", "--exclude=n3",
                    str(run_dir / "chain" / "57.sbatch")]
    assert (run_dir / "chain" / "57.sbatch").read_text().startswith("#!/bin/bash\n#SBATCH --nodes=2")
    assert (run_dir / "submitit" / "58_submitted.pkl").read_bytes() == b"pickled job"
    assert successor_of(run_dir, "57") == "58"


def test_an_sbatch_that_refuses_says_why_and_links_nothing(fake_slurm: Path) -> None:
    _fake(fake_slurm, "sbatch", 'echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" >&2\nexit 1\n')
    run_dir = fake_slurm / "run"
    run_dir.mkdir()
    successor, said = submit_successor(run_dir, "57", {"PATH": os.environ["PATH"]})
    assert successor is None and "QOSMaxSubmitJobPerUserLimit" in said
    assert successor_of(run_dir, "57") is None
