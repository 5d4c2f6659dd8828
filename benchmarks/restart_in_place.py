"""Fault to the next first step on the local Slurm cluster: a restart inside the job against a requeue.

    scripts/local_slurm.sh up && .venv/bin/python benchmarks/restart_in_place.py [--runs 1] [--steps 40]

Both paths train the tiny GPT on 2 nodes x 1 rank and meet the same fault: rank 1 raises NCCL's network error
("unhandled system error") at step 15, once. With ``retry.in_place = 2`` every rank's agent starts its rank again
inside the job; with ``retry.in_place = 0`` rank 1 requeues the job (``scontrol requeue``, the path of before).
The clock is the run folder's own: the fault is the "failed:" line of rank 1's log, the next attempt's start its
line in ``attempts.jsonl`` (rank 0 opens it once its model and data are built), and its first step the record
of the step after its checkpoint in ``metrics.jsonl``. Prints both phases and the ratio in place / requeue.
Target: <= 0.5.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from slurm_jobs import records, state

from hpc_train.run.node_log import rank_log_text

REPO = Path(__file__).resolve().parent.parent
FAULT_STEP = 15
BASE = ["--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set",
        "train.precision=fp32", "--set", "train.seq_len=64", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0", "--set", "checkpoint.every_steps=10", "--set", "env.HPC_TRAIN_INJECT_FAULT=network:1",
        "--set", f"env.HPC_TRAIN_INJECT_FAULT_STEP={FAULT_STEP}", "--set", "env.HPC_TRAIN_INJECT_FAULT_IN_PLACE=0",
        "--set", "env.HPC_TRAIN_INJECT_FAULT_RESTART=0"]


def _run(work: Path, steps: int, in_place: int) -> dict[str, float]:
    submitted = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                                *BASE, "--set", f"train.steps={steps}", "--set", f"retry.in_place={in_place}",
                                "--no-follow"], cwd=work, capture_output=True, text=True, timeout=300, check=True)
    (job_id,) = re.findall(r"submitted job (\d+)", submitted.stdout)
    run_dir = work / "runs" / "tiny-gpt"
    deadline = time.monotonic() + 600
    while not (state(job_id) == "COMPLETED" and (run_dir / "train.json").exists()):
        if time.monotonic() > deadline or state(job_id) in ("FAILED", "CANCELLED", "TIMEOUT"):
            raise SystemExit(f"job {job_id} ended {state(job_id)}; see {run_dir}/logs")
        time.sleep(0.5)
    metrics = {r["step"]: r["time"] for r in records(run_dir / "metrics.jsonl") if "loss" in r}
    attempts = records(run_dir / "attempts.jsonl")
    opened, resumed = attempts[1]["started"], attempts[1]["start_step"]  # the next life, or the requeued job
    line = next(x for x in rank_log_text(run_dir, 1).splitlines() if " ERROR failed:" in x)
    fault = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # logging's local time
    first = metrics[resumed + 1]  # metrics.jsonl keeps the replayed step, not the first life's
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.split()
    return {"to_next_attempt": opened - fault, "to_first_step": first - opened, "total": first - fault,
            "allocations": len(rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"in place": [], "requeue": []}
    with tempfile.TemporaryDirectory(prefix="hpc_train-restart-") as tmp:
        for run in range(args.runs):
            for name, in_place in (("in place", 2), ("requeue", 0)):
                work = Path(tmp) / f"{name.replace(' ', '_')}-{run}"
                work.mkdir()
                results[name].append(_run(work, args.steps, in_place))
    print(f"{'path':<10} {'fault to next attempt s':>24} {'to its first step s':>20} {'total s':>8} "
          f"{'allocations':>11}")
    for name, runs in results.items():
        for r in runs:
            print(f"{name:<10} {r['to_next_attempt']:>24.2f} {r['to_first_step']:>20.2f} {r['total']:>8.2f} "
                  f"{r['allocations']:>11.0f}")
    mean = {name: sum(r["total"] for r in runs) / len(runs) for name, runs in results.items()}
    print(f"fault to next first step, in place / requeue: {mean['in place'] / mean['requeue']:.3f} "
          f"({mean['in place']:.1f} s against {mean['requeue']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
