"""The memory tier on the real local Slurm cluster (``[checkpoint] memory_every_steps``): a rank killed with
``kill -9`` at a random step of a 2-node x 2-task job whose disk checkpoints are off for the run resumes from its
node's memory inside the same job, the ranks that saw the death in a collective training the next life in their own
processes (warm), and the run ends with an uninterrupted run's weights, bit for bit. (A lost node
whose ranks resume from a replica on another node: ``test_preemption_e2e``'s hot-spare test.)"""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hpc_train.run.node_log import rank_log_text
from tests.slurm.test_preemption_e2e import (
    NO_STANDBY,
    STEPS,
    _assert_same,
    _exported,
    _finished_run,
    _submit,
    _wait_until_completed,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
# 2 nodes (the tests' base) of 2 ranks each, ZeRO-2 (the default): only each node's first rank copies the module,
# and rank 1 links rank 0's copy when it loads
TWO_BY_TWO = ["--set", "job.tasks_per_node=2"]
MEMORY_ONLY = ["--set", "checkpoint.every_steps=1000", "--set", "checkpoint.memory_every_steps=10"]


@pytest.fixture(scope="module")
def uninterrupted_two_by_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    work = tmp_path_factory.mktemp("uninterrupted-2x2")
    _submit(work, STEPS, *TWO_BY_TWO, *NO_STANDBY, follow=True)
    return _exported(work / "runs" / "tiny-gpt", work / "weights.pt")


def test_a_rank_killed_at_a_random_step_resumes_from_its_node_s_memory(
        uninterrupted_two_by_two: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Rank 1 dies of SIGKILL at a random step; the disk holds no checkpoint (``every_steps`` past the run's end),
    memory a copy every 10 steps. Every rank starts again inside the job from the newest step every rank holds in
    its node's memory, and the run ends with the uninterrupted weights."""
    seed = int(time.time())  # printed on failure: the step is reproducible
    at_step = random.Random(seed).randint(12, STEPS - 5)  # noqa: S311 - not a secret
    run_dir = tmp_path / "runs" / "tiny-gpt"
    job_id = _submit(tmp_path, STEPS, *TWO_BY_TWO, *MEMORY_ONLY, "--set", "env.HPC_TRAIN_INJECT_FAULT=signal:1:9",
                     "--set", f"env.HPC_TRAIN_INJECT_FAULT_STEP={at_step}", "--set",
                     "env.HPC_TRAIN_INJECT_FAULT_IN_PLACE=0")
    _wait_until_completed(job_id, run_dir)
    first, second = _finished_run(run_dir, job_id)
    assert first["outcome"] == "killed" and second["in_place"] == 1 and second["restart"] == 0, (seed, first, second)
    # the newest copy before the kill: the one before at_step, or the one before that when the kill landed while
    # rank 1's writer thread was still sealing it
    newest_before = (at_step - 1) // 10 * 10
    assert second["start_step"] in (newest_before, newest_before - 10), (seed, second)
    assert int(second["start_step"]) > 0, (seed, second)
    rank0 = rank_log_text(run_dir, 0)
    assert f"resumed from memory at step {second['start_step']}" in rank0, rank0[-3000:]
    assert "4 rank(s) from their node's memory, 0 from a replica" in rank0, rank0[-3000:]
    assert "the newest disk checkpoint: none" in rank0, rank0[-3000:]
    # rank 0, in a collective with rank 1 when it died, trains the next life in its own process (a warm restart):
    # its agent hands it the order rather than to a standby or a new process
    assert "restarting warm: this process trains the next life" in rank0, rank0[-3000:]
    assert "rank(s) of this node restarted warm, in their own process" in rank0, rank0[-3000:]
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.split()
    assert rows == ["COMPLETED"], rows
    assert not list(Path("/dev/shm").glob(f"hpc_train-*/{job_id}-*")), "the agents left their memory behind"
    _assert_same(_exported(run_dir, tmp_path / "weights.pt"), uninterrupted_two_by_two, run_dir)
