"""Preemption on submitit's local executor, for real: signals sent to one rank at random steps, several per run.
Every time, the ranks agree, save, requeue (exit 144, the local executor restarts them) and resume; the run ends
with exactly the weights and optimizer state of an uninterrupted run, and attempts.jsonl tells the story."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpc_train.run.watch import last_logged_step, local_rank_pid
from tests.conftest import REPO

pytestmark = pytest.mark.slow
STEPS = 40
ARGS = ["--site", "local", "--set", f"train.steps={STEPS}", "--set", "checkpoint.every_steps=100", "--set",
        "train.precision=fp32", "--set", "monitor.log_every=1", "--set", "monitor.eval_every=5", "--set",
        "train.warmup_steps=2", "--set", "train.seq_len=64"]


def _submit(cwd: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                             *ARGS, *extra], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    state = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state"
    model = torch.load(state / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    tensors = {f"model.{k}": v for k, v in model.items()}
    for shard in sorted(state.glob("*optim_states.pt")):
        optim = torch.load(shard, weights_only=False)["optimizer_state_dict"]
        for i, flat in enumerate(optim["single_partition_of_fp32_groups"]):
            tensors[f"{shard.name}.fp32.{i}"] = flat
        for group, states in optim["base_optimizer_state"]["state"].items():
            for key, value in states.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{shard.name}.{group}.{key}"] = value
    return tensors


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    work = tmp_path_factory.mktemp("plain")
    process = _submit(work)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    return _final_state(work / "runs" / "tiny-gpt")


def test_signals_at_random_steps_end_with_the_uninterrupted_weights(
        uninterrupted: dict[str, torch.Tensor], tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "tiny-gpt"
    seed = int(time.time())  # printed on failure: the steps are reproducible
    plan = sorted(random.Random(seed).sample(range(3, STEPS - 5), 2))  # noqa: S311 - not a secret
    process = _submit(tmp_path)
    sent = [(at_step, "SIGUSR2") for at_step in plan]
    try:
        signal_at_steps(process, run_dir, plan)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-4000:]
    attempts = _attempts(run_dir)
    assert [a["outcome"] for a in attempts] == ["preempted"] * 2 + ["completed"], (seed, attempts)
    assert [a["signal"] for a in attempts[:2]] == [name for _, name in sent]
    assert all(a["requeued"] for a in attempts[:2]) and attempts[-1]["end_step"] == STEPS
    for before, after in itertools.pairwise(attempts):
        assert after["start_step"] == before["end_step"]  # nothing lost: each attempt starts where one stopped
    for (at_step, _), attempt in zip(sent, attempts, strict=False):
        assert attempt["end_step"] <= max(at_step, attempt["start_step"] + 1) + 3  # stopped within a few steps
    resumed = _final_state(run_dir)
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), f"{name} differs after {len(sent)} preemptions at {plan}"
    steps = sorted(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                   if "loss" in json.loads(line))
    assert steps == list(range(1, STEPS + 1))  # one metrics line per step across all attempts


def signal_at_steps(process: subprocess.Popen[str], run_dir: Path, plan: list[int]) -> None:
    """Send the site's signal (USR2) to rank 1 only, once the attempt of each signal has logged its step of
    ``plan``, and wait for the ranks to stop after each (the others learn of it at a step boundary)."""
    for index, at_step in enumerate(plan):
        deadline = time.monotonic() + 180
        while not _running(run_dir, attempt=index + 1, past=at_step):
            assert process.poll() is None and time.monotonic() < deadline, f"run ended before step {at_step}"
            time.sleep(0.02)
        os.kill(local_rank_pid(run_dir, 1), signal.SIGUSR2)
        deadline = time.monotonic() + 180  # wait until the ranks have stopped before the next signal
        while len([a for a in _attempts(run_dir) if a["outcome"] != "running"]) <= index:
            assert process.poll() is None and time.monotonic() < deadline, "no stop after the signal"
            time.sleep(0.05)


def _running(run_dir: Path, attempt: int, past: int) -> bool:
    """Attempt number ``attempt`` is training and has logged a step at or after ``past`` (or after its start)."""
    attempts = _attempts(run_dir)
    if len(attempts) != attempt or attempts[-1]["outcome"] != "running" or local_rank_pid(run_dir, 1) is None:
        return False
    return last_logged_step(run_dir) >= max(past, int(attempts[-1]["start_step"]) + 1)


def _attempts(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# A stop without a requeue (exit 75, "run the same command again"): tests/train/test_hf_gpt2.py sends USR2 with
# preempt.requeue = false; SIGTERM, which Slurm sends when it ends or requeues a job itself, is never followed
# by a requeue of the run's own (tests/train/test_preemption.py decides it; tests/slurm/test_preemption_e2e.py
# sees it on the cluster).
