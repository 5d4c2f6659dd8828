"""Crashes while the real trainer saves (2 ranks, ZeRO-2, fp32), which the manager's own tests cannot show: a rank
killed with SIGKILL while DeepSpeed writes its shards must leave the previous checkpoint verified and ``latest``
on it, and the same command run again must resume from it and end where an uninterrupted run ends. A bit flip in
the newest checkpoint (same size, so only ``checkpoint.verify = "sha256"`` sees it) must be skipped with a
warning. tests/checkpoint/test_manager.py covers SIGKILL of a bare writer and every kind of damage at the manager
level; tests/rank/train/test_resume.py covers a truncated shard through the trainer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from hpc_train.checkpoint.manager import CheckpointManager, inspect_checkpoint
from hpc_train.run.node_log import rank_log_text
from tests.conftest import REPO

pytestmark = pytest.mark.slow
STEPS, KILLED_STEP, PREVIOUS_STEP = 6, 4, 2
# vocab 16384 makes a 74 MB checkpoint: DeepSpeed writes for a few tenths of a second, long enough to kill a
# rank in the middle of it; micro batch 2 keeps the steps short.
ARGS = ["--site", "local", "--set", f"train.steps={STEPS}", "--set", "checkpoint.every_steps=2", "--set",
        "checkpoint.verify=sha256", "--set", "train.precision=fp32", "--set", "train.seq_len=64", "--set",
        "train.micro_batch=2", "--set", "data.vocab_size=16384", "--set", "train.warmup_steps=2", "--set",
        "monitor.log_every=1", "--set", "monitor.eval_every=0"]
SHARDS = {0: "mp_rank_00_model_states.pt", 1: "zero_pp_rank_1_mp_rank_00_optim_states.pt"}  # each rank's first
TIMEOUT_S = 300
T = TypeVar("T")


def _command() -> list[str]:
    return [sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"), *ARGS]


def _run(cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(_command(), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _weights(run_dir: Path, step: int) -> dict[str, object]:
    """The module weights DeepSpeed saved at ``step`` (our own file, so a full unpickle is fine)."""
    import torch

    path = run_dir / "checkpoints" / f"step-{step:08d}" / "state" / SHARDS[0]
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    work = tmp_path_factory.mktemp("uninterrupted")
    _run(work)
    run_dir = work / "runs" / "tiny-gpt"
    return run_dir, _losses(run_dir)


def _wait_for(found: Callable[[], T | None], proc: subprocess.Popen[str], what: str) -> T:
    """Poll every millisecond until ``found()`` is truthy; fail if the job ends or time runs out first."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if result := found():
            return result
        time.sleep(0.001)
    pytest.fail(f"{what} did not happen (submit exited with {proc.poll()})")


def _rank_pids(submitit_folder: Path) -> dict[int, int]:
    """Rank -> pid of this job's submitit tasks: their command line names our own submitit folder."""
    pids = {}
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"submitit.core._submit" not in argv or str(submitit_folder).encode() not in argv:
                continue
            environ = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0")
                           if b"=" in item)
        except OSError:  # not a pid, or it ended meanwhile
            continue
        pids[int(environ[b"SUBMITIT_LOCAL_GLOBALID"])] = int(entry.name)
    return pids


def _both_ranks(submitit_folder: Path) -> dict[int, int] | None:
    pids = _rank_pids(submitit_folder)
    return pids if len(pids) == 2 else None


def _kill_rank_mid_save(cwd: Path, rank: int) -> tuple[Path, str]:
    """Start the job, SIGKILL ``rank`` once its shard of step KILLED_STEP appears in the temporary folder; return
    that folder and what submit printed. Its own session, so a job that hangs can be killed whole."""
    run_dir = (cwd / "runs" / "tiny-gpt").resolve()
    proc = subprocess.Popen(_command(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        pids = _wait_for(lambda: _both_ranks(run_dir / "submitit"), proc, "both ranks starting")
        pattern = f".tmp-step-{KILLED_STEP:08d}-*/state/{SHARDS[rank]}"
        shard = _wait_for(lambda: next((run_dir / "checkpoints").glob(pattern), None), proc,
                          f"rank {rank} writing step {KILLED_STEP}")
        os.kill(pids[rank], signal.SIGKILL)
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0, output[-4000:]
    return shard.parent.parent, output


# Rank 0 commits the checkpoint (manifest, rename, latest): its death mid-save is the case to survive. A writer
# killed on any rank is tests/checkpoint/test_manager.py's (SIGKILL of a bare writer).
@pytest.mark.parametrize("rank", [0], ids=["rank0-the-committer"])
def test_sigkill_mid_save_resumes_from_the_previous_checkpoint(uninterrupted: tuple[Path, dict[int, float]],
                                                               tmp_path: Path, rank: int) -> None:
    reference, losses = uninterrupted
    tmp, output = _kill_rank_mid_save(tmp_path, rank)
    run_dir = tmp_path / "runs" / "tiny-gpt"
    assert tmp.is_dir() and not (tmp / "manifest.json").exists(), output[-4000:]
    assert not _step_dir(run_dir, KILLED_STEP).exists()
    assert _latest(run_dir) == f"step-{PREVIOUS_STEP:08d}"
    manifest, problem = inspect_checkpoint(_step_dir(run_dir, PREVIOUS_STEP), "sha256")
    assert problem is None and manifest is not None and manifest.step == PREVIOUS_STEP
    assert CheckpointManager(run_dir / "checkpoints", keep=2, verify="sha256").latest_verified() == \
        _step_dir(run_dir, PREVIOUS_STEP)

    result = _run(tmp_path)
    assert f"resumed from step {PREVIOUS_STEP}" in result.stdout
    assert _losses(run_dir) == losses and sorted(losses) == list(range(1, STEPS + 1))
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the next save removed the crashed one's folder
    assert _latest(run_dir) == f"step-{STEPS:08d}"
    resumed, expected = _weights(run_dir, STEPS), _weights(reference, STEPS)
    assert resumed.keys() == expected.keys()
    assert all(resumed[name].equal(expected[name]) for name in expected)  # type: ignore[attr-defined]


def test_bit_flipped_newest_checkpoint_is_skipped_with_a_warning(uninterrupted: tuple[Path, dict[int, float]],
                                                                 tmp_path: Path) -> None:
    reference, losses = uninterrupted
    work = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(reference.parent.parent), str(work)], check=True)
    run_dir = work / "runs" / "tiny-gpt"
    shard = _step_dir(run_dir, STEPS) / "state" / SHARDS[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only sha256 can tell
    shard.write_bytes(bytes(data))
    assert inspect_checkpoint(_step_dir(run_dir, STEPS), "size")[1] is None
    (run_dir / "metrics.jsonl").write_text("")  # only what the rerun trains

    result = _run(work)
    assert f"resumed from step {KILLED_STEP}" in result.stdout
    assert _losses(run_dir) == {step: losses[step] for step in range(KILLED_STEP + 1, STEPS + 1)}
    # The manager warns through logging: today that reaches only rank 0's stderr file (submitit's), so look there
    # and wherever else it may be routed later.
    files = list((run_dir / "submitit").glob("*_0_log.err"))
    said = result.stdout + "".join(path.read_text() for path in files) + rank_log_text(run_dir, 0)
    assert f"step-{STEPS:08d} skipped: state/{SHARDS[1]} is corrupt: sha256 differs" in said
