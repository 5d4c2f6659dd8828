"""From a preemption signal to a durable checkpoint, and the steps a preemption loses.

    .venv/bin/python benchmarks/preemption.py [--runs 3] [--at 30] [--smoke]

Each run trains the quick-start example through ``hpc_train.submit`` (local executor, 2 ranks, ZeRO-2) with no
periodic checkpoints, sends SIGUSR2 to rank 1 once step ``--at`` is logged, and times until ``checkpoints/latest``
names the new checkpoint (the moment it is durable: fsynced, sealed, renamed). Steps lost = the last step logged
when the signal was sent minus the step saved (0 or less: nothing to redo). The baseline is the same run's own
periodic save: how long a save of the same state takes when nobody is waiting for a signal. Targets: steps
lost 0; signal to durable well under the 60 s lead time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc_train.run.watch import last_logged_step, local_rank_pid

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--site", "local", "--set", "checkpoint.every_steps=1000", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0"]
STEPS = 200
RANKS = 2
# --smoke: 1 rank (signalled itself: the same handler, agreement and save, at half the processes), and the
# learning rate warmed up for 1 step (the example's 20 would need 20 steps)
SMOKE = {"at": 2, "steps": 8, "ranks": 1, "sets": ["train.warmup_steps=1"]}


def _one_run(work: Path, at: int, steps: int = STEPS, ranks: int = RANKS,
             sets: tuple[str, ...] = ()) -> dict[str, float]:
    run_dir = work / "runs" / "tiny-gpt"
    signalled = ranks - 1  # rank 1 of 2: its signal must reach rank 0 through the agreement
    extra = [arg for item in (f"train.steps={steps}", f"job.tasks_per_node={ranks}", *sets) for arg in ("--set", item)]
    process = subprocess.Popen([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                                *ARGS, *extra], cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while last_logged_step(run_dir) < at or local_rank_pid(run_dir, signalled) is None:
            if process.poll() is not None:
                raise RuntimeError(f"the run ended before step {at}")
            time.sleep(0.01)
        step_at_signal = last_logged_step(run_dir)
        sent = time.monotonic()
        os.kill(local_rank_pid(run_dir, signalled), signal.SIGUSR2)
        latest = run_dir / "checkpoints" / "latest"
        while not latest.exists():
            time.sleep(0.002)
        durable = time.monotonic() - sent
        saved = int(latest.read_text().strip().removeprefix("step-"))
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    return {"durable_s": durable, "at": step_at_signal, "lost": step_at_signal - saved,
            "save_s": attempts[0]["save_s_max"],
            "step_s": attempts[0]["step_s_max"], "resumed_at": attempts[1]["start_step"], "saved": saved,
            "completed": attempts[-1]["outcome"] == "completed"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--at", type=int, default=30, help="the step after which the signal is sent")
    parser.add_argument("--smoke", action="store_true", help=f"one run of {SMOKE['steps']} steps on "
                        f"{SMOKE['ranks']} rank, the signal after step {SMOKE['at']}: the benchmark runs end to end in "
                        "seconds (CI), its figures mean nothing")
    args = parser.parse_args()
    steps, ranks, sets = (SMOKE["steps"], SMOKE["ranks"], SMOKE["sets"]) if args.smoke else (STEPS, RANKS, [])
    if args.smoke:
        args.runs, args.at = 1, SMOKE["at"]
    results = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="hpc_train-preempt-") as folder:
            result = _one_run(Path(folder), args.at, steps, ranks, tuple(sets))
        results.append(result)
        print(f"run {index + 1}: signal after step {result['at']}, saved step "
              f"{result['saved']}, durable {result['durable_s']:.2f} s after the signal (the save itself "
              f"{result['save_s']:.2f} s, slowest step {result['step_s']:.2f} s); resumed at step "
              f"{result['resumed_at']}; completed: {result['completed']}")
    durable = [r["durable_s"] for r in results]
    saves = [r["save_s"] for r in results]
    print(f"signal to durable checkpoint: median {statistics.median(durable):.2f} s, max {max(durable):.2f} s "
          f"(a plain save of the same state: median {statistics.median(saves):.2f} s, ratio "
          f"{statistics.median(durable) / statistics.median(saves):.2f})")
    print(f"steps lost per preemption: max {max(0, max(int(r['lost']) for r in results))} (target 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
