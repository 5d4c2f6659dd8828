"""Save and resume through the real trainer (2 ranks, ZeRO-2, fp32): a resumed run continues bit for bit where
the uninterrupted one went, metrics.jsonl keeps one line per step, and a damaged newest checkpoint falls back
to the previous good one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.run.node_log import rank_log_text
from tests.conftest import REPO

pytestmark = pytest.mark.slow
ARGS = ["--site", "local", "--set", "train.steps=8", "--set", "checkpoint.every_steps=4", "--set",
        "train.precision=fp32", "--set", "monitor.log_every=1", "--set", "monitor.eval_every=0", "--set",
        "train.warmup_steps=2", "--set", "train.seq_len=64"]


def _run(cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                             *ARGS], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    work = tmp_path_factory.mktemp("resume")
    _run(work)
    run_dir = work / "runs" / "tiny-gpt"
    return run_dir, _losses(run_dir / "metrics.jsonl")


def _rewind_to_step_4(run_dir: Path) -> None:
    """As if the job had been preempted after its step-4 checkpoint."""
    checkpoints = run_dir / "checkpoints"
    for path in sorted((checkpoints / "step-00000008").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (checkpoints / "step-00000008").rmdir()
    (checkpoints / "latest").write_text("step-00000004\n")


def test_checkpoints_are_committed_with_manifests(trained: tuple[Path, dict[int, float]]) -> None:
    run_dir, _ = trained
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000008"
    manifest = json.loads((checkpoints / "step-00000008" / "manifest.json").read_text())
    assert manifest["step"] == 8 and manifest["world_size"] == 2 and manifest["zero_stage"] == 2
    rng = {entry["path"] for entry in manifest["files"] if entry["path"].startswith("rng/")}
    assert rng == {"rng/ranks-0-1.pt"}  # the random states of the node's two ranks, in one file
    assert not list(checkpoints.glob(".tmp-*"))


def test_resume_continues_bit_for_bit(trained: tuple[Path, dict[int, float]], tmp_path: Path) -> None:
    run_dir, uninterrupted = trained
    work = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run_dir.parent.parent), str(work)], check=True)
    copy = work / "runs" / "tiny-gpt"
    _rewind_to_step_4(copy)
    result = _run(work)
    assert "resumed from step 4" in result.stdout
    resumed = _losses(copy / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, 9))  # one line per step, no duplicates
    assert resumed == uninterrupted  # steps 5-8 again, exactly


def test_a_damaged_newest_checkpoint_falls_back(trained: tuple[Path, dict[int, float]], tmp_path: Path) -> None:
    run_dir, uninterrupted = trained
    work = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run_dir.parent.parent), str(work)], check=True)
    copy = work / "runs" / "tiny-gpt"
    shard = next((copy / "checkpoints" / "step-00000008" / "state").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated, as by a crash or a full disk
    (copy / "checkpoints" / "latest").write_text("step-00000008\n")
    result = _run(work)
    assert "resumed from step 4" in result.stdout
    # The reason reaches the console of submit and rank 0's log, not only the rank's stderr.
    warning = f"warning: checkpoint {copy / 'checkpoints' / 'step-00000008'} skipped"
    assert warning in result.stdout and warning in rank_log_text(copy, 0)
    assert _losses(copy / "metrics.jsonl") == uninterrupted
