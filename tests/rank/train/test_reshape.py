"""Resuming on another number of ranks through the real trainer (fp32): a checkpoint saved by 2 ranks goes on
at 1 and at 4 ranks (ZeRO-2) and at 1 rank (ZeRO-3) through DeepSpeed's universal checkpoint, with the same
global batch, and follows the uninterrupted 2-rank run; the sealed checkpoint is never touched; a tensor-size
change is refused.

Tolerance: 2e-6 absolute on the losses of steps 5 and 6. fp32 reductions sum in another order on another
number of ranks: measured differences are 1-3e-7. Every run uses one thread per rank (``job.cpus_per_task=1``):
a rank with two threads may pick another matrix-multiply kernel under load, which once moved a step-5 loss
by 7e-6 in CI. Tight on purpose: DeepSpeed's ZeRO-3 universal load, left
alone, gives the no-decay parameter group weight decay and shares one Adam step counter among the groups, which
moves the step-6 loss by 5e-5 and 1.7e-5.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_train.checkpoint import CheckpointManager, inspect_checkpoint
from hpc_train.checkpoint.universal import CACHE_NAME, cached_copy, clear_cache, compare_layouts, convert_to_universal
from hpc_train.errors import ConfigError
from hpc_train.run.node_log import rank_log_text
from tests.conftest import REPO

pytestmark = pytest.mark.slow
ARGS = ["--site", "local", "--set", "train.steps=6", "--set", "checkpoint.every_steps=4", "--set",
        "train.precision=fp32", "--set", "train.seq_len=64", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0", "--set", "train.warmup_steps=2", "--set", "job.cpus_per_task=1"]
TOLERANCE = 2e-6
STEP_4 = "step-00000004"


def _submit(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                           *ARGS, *sets], cwd=cwd, capture_output=True, text=True, timeout=400, check=False)


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


Trained = Callable[[int], tuple[Path, dict[int, float]]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """``trained(stage)``: a run of 2 ranks, micro batch 8, ZeRO ``stage``, to step 6 (checkpoints at steps 4
    and 6) and its uninterrupted losses; each stage is trained once per module."""
    runs: dict[int, tuple[Path, dict[int, float]]] = {}

    def run(stage: int) -> tuple[Path, dict[int, float]]:
        if stage not in runs:
            work = tmp_path_factory.mktemp(f"zero{stage}")
            result = _submit(work, f"zero.stage={stage}")
            assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
            run_dir = work / "runs" / "tiny-gpt"
            runs[stage] = run_dir, _losses(run_dir)
        return runs[stage]

    return run


def _rewound_copy(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run as if it had stopped after its step-4 checkpoint; returns the copy's working folder."""
    work = tmp_path / "copy"
    shutil.copytree(run_dir.parent.parent, work, symlinks=True)
    checkpoints = work / "runs" / "tiny-gpt" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000006")
    (checkpoints / "latest").write_text(STEP_4 + "\n")
    return work


# Fewer ranks at ZeRO-2 (2 -> 1): tests/rank/train/test_hf_gpt2.py resumes a user model that way.
@pytest.mark.parametrize(("stage", "ranks", "batch"), [(2, 4, "train.micro_batch=4"), (3, 1, "train.grad_accum=2")])
def test_resume_on_another_rank_count_follows_the_uninterrupted_run(trained: Trained, tmp_path: Path, stage: int,
                                                                    ranks: int, batch: str) -> None:
    run_dir, uninterrupted = trained(stage)
    work = _rewound_copy(run_dir, tmp_path)
    copy = work / "runs" / "tiny-gpt"
    result = _submit(work, f"zero.stage={stage}", f"job.tasks_per_node={ranks}", batch)  # global batch stays 16
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    said = [line for line in rank_log_text(copy, 0).splitlines() if "universal" in line]
    assert len(said) == 1, said
    assert (f"checkpoint {STEP_4} was saved by 2 ranks (data 2); converting to a universal checkpoint for "
            f"{ranks} rank{'s' if ranks > 1 else ''} (data {ranks})") in said[0]
    assert "resumed from step 4 (epoch 0, offset 64)" in result.stdout  # the global position, unchanged
    resumed = _losses(copy)
    assert sorted(resumed) == list(range(1, 7))
    for step in (5, 6):
        assert abs(resumed[step] - uninterrupted[step]) < TOLERANCE, (step, resumed, uninterrupted)
    checkpoints = copy / "checkpoints"
    assert inspect_checkpoint(checkpoints / STEP_4, "sha256")[1] is None  # the sealed checkpoint is untouched
    listed = CheckpointManager(checkpoints, keep=2, verify="sha256").list()
    assert [(info.step, info.error) for info in listed] == [(4, None), (6, None)]
    assert listed[1].manifest is not None and listed[1].manifest.layout["data"] == ranks
    cache = checkpoints / CACHE_NAME
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert [path.name for path in cache.iterdir()] == [STEP_4]


def test_a_tensor_size_change_is_refused_before_loading(trained: Trained, tmp_path: Path) -> None:
    run_dir, _ = trained(2)
    work = _rewound_copy(run_dir, tmp_path)
    result = _submit(work, "parallel.tensor=2")
    assert result.returncode != 0
    assert ("saved by 2 ranks (tensor 1, pipeline 1, data 2), but this job runs 2 ranks (tensor 2, pipeline 1, "
            "data 1): the tensor size cannot change on resume") in result.stdout
    assert "set parallel.tensor = 1 to resume this run" in result.stdout
    assert "checkpoint.resume = false" in result.stdout
    checkpoints = work / "runs" / "tiny-gpt" / "checkpoints"
    assert not (checkpoints / CACHE_NAME).exists()
    assert (checkpoints / "latest").read_text().strip() == STEP_4


def test_the_universal_copy_is_reused_for_the_same_checkpoint_only(trained: Trained, tmp_path: Path) -> None:
    run_dir, _ = trained(2)
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", checkpoints, symlinks=True)
    sealed = checkpoints / STEP_4
    assert cached_copy(sealed, "state") is None
    folder, seconds = convert_to_universal(sealed, "state")
    assert seconds > 0 and folder == checkpoints / CACHE_NAME / STEP_4
    assert (folder / "state" / "zero" / "optimizer_state.pt").is_file()
    assert cached_copy(sealed, "state") == folder  # a requeue at the new size converts nothing
    assert inspect_checkpoint(sealed, "sha256")[1] is None
    manifest = sealed / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"created": ', '"created": 1'))  # as if saved again
    assert cached_copy(sealed, "state") is None
    convert_to_universal(checkpoints / "step-00000006", "state")
    assert [path.name for path in (checkpoints / CACHE_NAME).iterdir()] == ["step-00000006"]  # one copy at most
    clear_cache(checkpoints)
    assert list((checkpoints / CACHE_NAME).iterdir()) == []


def test_only_the_data_parallel_size_may_change() -> None:
    saved = {"tensor": 2, "pipeline": 1, "data": 2, "context": 1}
    assert compare_layouts("x", saved, 4, saved, 4) is False
    assert compare_layouts("x", saved, 4, {**saved, "data": 4}, 8) is True
    with pytest.raises(ConfigError, match=r"the pipeline size cannot change.*Fix: set parallel.pipeline = 1"):
        compare_layouts("x", saved, 4, {**saved, "pipeline": 2, "data": 1}, 4)
