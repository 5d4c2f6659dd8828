"""User programs on submitit's local executor, 2 ranks on gloo, for real: an unmodified torchrun-style DDP script
ends with the weights ``torchrun`` gives; a function using ``ctx.checkpoint``, ``ctx.should_stop`` and ``ctx.log``
is sent USR2 at random steps and ends bitwise equal to an uninterrupted run, with every step in metrics.jsonl
once; a script that never asks is requeued after the grace period and resumes from what it saved itself."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpc_train.run.node_log import rank_log_text
from hpc_train.run.watch import last_logged_step, local_rank_pid
from tests.conftest import REPO, torchrun

pytestmark = pytest.mark.slow
OWN_LOOP = str(REPO / "examples" / "own_loop" / "job.toml")
DDP_SCRIPT = str(REPO / "examples" / "ddp_script" / "job.toml")
STEPS = 60


def start(cwd: Path, config: str, *overrides: str) -> subprocess.Popen[str]:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return subprocess.Popen([sys.executable, "-m", "hpc_train.submit", config, "--site", "local", *sets], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def running(process: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """The submitting command while a test signals its ranks; killed if the test fails before it ends."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()


def finished(process: subprocess.Popen[str]) -> str:
    """What the follower printed, once the run ended with status 0."""
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    return output


def submit(cwd: Path, config: str, *overrides: str) -> tuple[int, str]:
    """Submit and follow to the end: (exit status, what the follower printed)."""
    process = start(cwd, config, *overrides)
    output, _ = process.communicate(timeout=300)
    return process.returncode, output


def attempts(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_model(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    saved = torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / "ranks" / "rank-0.pt", weights_only=True)
    return saved["objects"]["model"] | {f"optimizer.{k}": v for k, v in _flat(saved["objects"]["optimizer"])}


def _flat(state: dict[str, object], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    items = []
    for key, value in state.items():
        if isinstance(value, dict):
            items += _flat(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            items.append((f"{prefix}{key}", value))
    return items


def test_an_unmodified_ddp_script_ends_with_torchrun_s_weights(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "hpc_train.pt", tmp_path / "torchrun.pt"
    code, output = submit(tmp_path, DDP_SCRIPT, f'job.args=["--epochs", "2", "--out", "{ours}"]')
    assert code == 0, output[-3000:]
    baseline = torchrun([str(REPO / "examples" / "ddp_script" / "train_cnn.py"), "--epochs", "2", "--out",
                         str(theirs)], tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    a, b = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    run_dir = tmp_path / "runs" / "ddp-cnn"
    rank0 = rank_log_text(run_dir, 0)
    assert "epoch 1: mean loss" in rank0  # the script's prints are in the log the login node follows
    assert [a["outcome"] for a in attempts(run_dir)] == ["completed"]
    assert (run_dir / "program.json").exists()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    work = tmp_path_factory.mktemp("plain")
    code, output = submit(work, OWN_LOOP, f"params.steps={STEPS}", "params.save_every=1000")
    assert code == 0, output[-3000:]
    return final_model(work / "runs" / "own-loop")


def _wait(condition: object, process: subprocess.Popen[str], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert process.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def test_a_function_stopped_at_random_steps_ends_with_the_uninterrupted_weights(
        uninterrupted: dict[str, torch.Tensor], tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "own-loop"
    seed = int(time.time())  # in the failure message: the steps are reproducible
    # ctx.log writes its records every monitor.log_every (10) steps, so a signal planned at step N is sent up to
    # 10 steps later: the last planned step leaves room for that and for the agreement before step STEPS
    at_steps = sorted(random.Random(seed).sample(range(3, STEPS - 20), 2))  # noqa: S311 - not a secret
    overrides = (f"params.steps={STEPS}", "params.save_every=1000", "params.step_sleep=0.05")
    with running(start(tmp_path, OWN_LOOP, *overrides)) as process:
        for index, step in enumerate(at_steps):
            # this attempt has logged a step of its own (its handlers are in place, its pid file is its own)
            _wait(lambda: len(attempts(run_dir)) == index + 1 and last_logged_step(run_dir)  # noqa: B023
                  >= max(step, int(attempts(run_dir)[-1]["start_step"]) + 1)  # noqa: B023
                  and local_rank_pid(run_dir, 1) is not None, process, f"step {step} (seed {seed})")
            os.kill(local_rank_pid(run_dir, 1), signal.SIGUSR2)  # one rank: the others learn of it from should_stop
            _wait(lambda: len([a for a in attempts(run_dir) if a["outcome"] != "running"]) > index,  # noqa: B023
                  process, f"a stop after the signal at step {step} (seed {seed})")
        finished(process)
    runs = attempts(run_dir)
    assert [a["outcome"] for a in runs] == ["preempted"] * 2 + ["completed"], (seed, runs)
    assert all(a["signal"] == "SIGUSR2" and a["requeued"] for a in runs[:2])
    for before, after in itertools.pairwise(runs):
        assert after["start_step"] == before["end_step"], (seed, runs)  # saved where it stopped: nothing lost
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1)), (seed, logged)
    resumed = final_model(run_dir)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), seed
    # and its picture marks both preemptions and both restarts where attempts.jsonl puts them
    plotted = subprocess.run([sys.executable, "-m", "hpc_train", "plot", str(run_dir), "--json", "--out",
                              str(tmp_path / "run.png")], capture_output=True, text=True, timeout=120, check=True)
    drawn = json.loads(plotted.stdout)["runs"][0]
    assert [(m["kind"], m["step"], m["attempt"]) for m in drawn["marks"]] == [
        ("preempted", runs[0]["end_step"], 1), ("start", runs[1]["start_step"], 2),
        ("preempted", runs[1]["end_step"], 2), ("start", runs[2]["start_step"], 3)]
    assert drawn["points"]["loss"] == STEPS and (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    # ckpt ls names what wrote the folders: the function, not a ZeRO stage of an engine it never had
    listed = subprocess.run([sys.executable, "-m", "hpc_train", "ckpt", "ls", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(listed.stdout)["checkpoints"]
    assert rows and {(row["engine"], row["zero_stage"]) for row in rows} == {("program", None)}, listed.stdout


UNASKED = """
import os, sys, time, pathlib
import torch.distributed as dist
dist.init_process_group("gloo")
progress = pathlib.Path(sys.argv[1]) / f"done-{dist.get_rank()}"
start = int(progress.read_text()) if progress.exists() else 0
for step in range(start + 1, 151):
    time.sleep(0.1)
    progress.with_suffix(".tmp").write_text(str(step))  # a kill mid-write leaves the old count, as a real
    os.replace(progress.with_suffix(".tmp"), progress)  # program that saves its own state must
dist.barrier()
print(f"finished at {step}", flush=True)
dist.destroy_process_group()
"""


def test_a_script_that_never_asks_is_requeued_and_resumes_from_its_own_state(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text(UNASKED)
    (tmp_path / "job.toml").write_text(f'[job]\nname = "plain"\nprogram = "plain.py"\nargs = ["{tmp_path}"]\n'
                                       "tasks_per_node = 2\n")
    run_dir = tmp_path / "runs" / "plain"
    with running(start(tmp_path, str(tmp_path / "job.toml"))) as process:
        _wait(lambda: (tmp_path / "done-0").exists() and int((tmp_path / "done-0").read_text() or 0) >= 5
              and local_rank_pid(run_dir, 0) is not None and local_rank_pid(run_dir, 1) is not None, process,
              "step 5")
        for rank in (0, 1):  # as Slurm does: every rank gets the signal
            os.kill(local_rank_pid(run_dir, rank), signal.SIGUSR2)
        finished(process)
    runs = attempts(run_dir)
    assert [a["outcome"] for a in runs] == ["preempted", "completed"], runs
    assert runs[0]["requeued"] and "did not ask should_stop()" in str(runs[0]["note"])
    log = rank_log_text(run_dir, 0)
    assert "did not ask should_stop() within 10 s" in log  # lead 60 / 6
    assert "finished at 150" in log
