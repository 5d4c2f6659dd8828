"""Sending the site's preemption signal to one rank at planned steps, for the tests that preempt local runs.

The built-in GPT's run through signals back to the uninterrupted weights is covered on the local executor by
scripts/gpu_check.sh's resume step (CI runs its dry run, tests/benchmarks/test_gpu_check.py) and by
tests/rank/train/test_hf_gpt2.py for a Hugging Face GPT-2 at random steps; tests/slurm/test_preemption_e2e.py does
it on the cluster. A stop without a requeue (exit 75): tests/rank/train/test_hf_gpt2.py; SIGTERM, which Slurm sends
when it ends or requeues a job itself, is never followed by a requeue of the run's own
(tests/rank/runtime/test_preemption.py decides it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from hpc_train.rank.runtime.preemption import MAX_STEPS_PER_ROUND
from hpc_train.run.watch import last_logged_step, local_rank_pid


def two_signal_steps(seed: int, steps: int) -> list[int]:
    """Two random steps to signal after, at least 3 apart, each leaving its stop room before the end. The ranks
    agree on a signal one to two rounds after it came (a round is about 0.2 s of steps, at most
    MAX_STEPS_PER_ROUND of them), so a signal sent once step s is logged stops them by step s + ``late`` - 1.
    The second signal goes once the next attempt runs, so the first one's stop must leave it that room too."""
    late = 2 * MAX_STEPS_PER_ROUND + 2  # the round in flight, the round that sees the signal, the step it came in
    last = steps - late  # a signal after this step could be agreed at the last step, which no longer stops
    rng = random.Random(seed)  # noqa: S311 - not a secret
    first = rng.randrange(3, min(steps // 2 - 1, last - late) + 1)
    return [first, rng.randrange(first + 3, last + 1)]


def signal_at_steps(process: subprocess.Popen[str], run_dir: Path, plan: list[int]) -> None:
    """Send the site's signal (USR2) to rank 1 only, once the attempt of each signal has logged its step of
    ``plan``, and wait for the ranks to stop after each (the others learn of it at a step boundary)."""
    for index, at_step in enumerate(plan):
        deadline = time.monotonic() + 180
        while not running(run_dir, attempt=index + 1, past=at_step):
            assert process.poll() is None and time.monotonic() < deadline, f"run ended before step {at_step}"
            time.sleep(0.02)
        os.kill(local_rank_pid(run_dir, 1), signal.SIGUSR2)
        deadline = time.monotonic() + 180  # wait until the ranks have stopped before the next signal
        while len([a for a in attempts(run_dir) if a["outcome"] != "running"]) <= index:
            assert process.poll() is None and time.monotonic() < deadline, "no stop after the signal"
            time.sleep(0.05)


def running(run_dir: Path, attempt: int, past: int) -> bool:
    """Attempt number ``attempt`` is training and has logged a step at or after ``past`` (or after its start)."""
    found = attempts(run_dir)
    if len(found) != attempt or found[-1]["outcome"] != "running" or local_rank_pid(run_dir, 1) is None:
        return False
    return last_logged_step(run_dir) >= max(past, int(found[-1]["start_step"]) + 1)


def attempts(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
