"""checkpoint.async_save (the default): every rank stages its files in memory and writes them in a thread, rank 0
commits (manifest, rename, ``latest``) in another while training goes on. The run trains exactly as with
synchronous saves, its checkpoints hold the same state as the synchronous run's (the staged copy is the state at
the save, not what training made of it since), every checkpoint it keeps verifies and ``latest`` names the last
one. (Resuming from asynchronous checkpoints: every resume test, since they are the default.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_train.checkpoint.deepspeed_files import load_safely
from tests.conftest import REPO

pytestmark = pytest.mark.slow
ARGS = ["--site", "local", "--set", "train.steps=8", "--set", "checkpoint.every_steps=2", "--set",
        "checkpoint.verify=sha256", "--set", "train.precision=fp32", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0", "--set", "train.warmup_steps=2", "--set", "train.seq_len=64"]


def _run(cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                             *ARGS, *extra], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def _losses(run_dir: Path) -> dict[int, float]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def _assert_same(left: Any, right: Any, where: str) -> None:
    if torch.is_tensor(left):
        assert torch.is_tensor(right) and left.dtype == right.dtype and torch.equal(left, right), where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and list(left) == list(right), where
        for key in left:
            _assert_same(left[key], right[key], f"{where}/{key}")
    elif isinstance(left, list | tuple):
        assert type(left) is type(right) and len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            _assert_same(a, b, f"{where}[{index}]")
    elif hasattr(left, "__dict__"):  # DeepSpeed's loss scaler: no __eq__
        assert type(left) is type(right), where
        _assert_same(vars(left), vars(right), where)
    else:
        assert left == right, where


def test_async_saves_train_the_same_and_every_checkpoint_verifies(tmp_path: Path) -> None:
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync_dir.mkdir()
    async_dir.mkdir()
    _run(sync_dir, "--set", "checkpoint.async_save=false")
    _run(async_dir)
    run = async_dir / "runs" / "tiny-gpt"
    assert _losses(run) == _losses(sync_dir / "runs" / "tiny-gpt")
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000008"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000006", "step-00000008"]  # keep = 2
    assert not list(checkpoints.glob(".tmp-*")) and not list(checkpoints.glob("*/.written"))
    for step in ("step-00000006", "step-00000008"):
        staged, written = (root / step / "state" for root in (checkpoints, sync_dir / "runs" / "tiny-gpt" /
                                                               "checkpoints"))
        names = sorted(p.name for p in written.glob("*.pt"))
        assert names == sorted(p.name for p in staged.glob("*.pt")) and len(names) >= 3
        for name in names:  # DeepSpeed's files hold the same state (the staged copy keeps no storage sharing)
            _assert_same(load_safely((staged / name).read_bytes()), load_safely((written / name).read_bytes()), name)
    verify = subprocess.run([sys.executable, "-m", "hpc_train", "ckpt", "verify", str(run), "--sha256"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert verify.returncode == 0 and "FAILED" not in verify.stdout, verify.stdout + verify.stderr
