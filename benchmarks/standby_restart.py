"""``kill -9`` of a rank to the first step of the next life, with standby ranks against cold starts, on the local
Slurm cluster.

    scripts/local_slurm.sh up && .venv/bin/python benchmarks/standby_restart.py [--runs 3] [--steps 40] [--smoke]

Both paths train the tiny GPT on 2 nodes x 1 rank with ``retry.in_place = 2``; rank 0's first life is slowed by
1 s per step (``slow:0:1000``) so that the kill lands mid-run. Once step 15 is logged (and, with standbys, once both
nodes' agents said their standby is ready), this script sends rank 1 SIGKILL and reads the clock of the run folder:
the next life's line in ``attempts.jsonl`` (rank 0 opens it once its model and data are built) and the record of
the first step after the checkpoint it resumed from in ``metrics.jsonl``. ``retry.standby = false`` is the
baseline: every rank of the next life a new interpreter that imports torch again. With standbys, rank 0 (which
sees rank 1's death in a collective) may also train the next life in its own process: each run says whether it
did (``rank 0 warm``). Prints each run, the medians and the ratio standby / cold. Target (issue 42): at most 2 s
from the kill to the next first step.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_jobs import rank_pid, records, state, wait

from hpc_train.bench.machine import machine, spread
from hpc_train.run.node_log import rank_log_text
from hpc_train.run.watch import last_logged_step

REPO = Path(__file__).resolve().parent.parent
KILL_AFTER_STEP = 15
READY = "standby rank(s) ready for the next life"
WARM = "1 rank(s) of this node restarted warm"
BASE = ["--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set",
        "train.precision=fp32", "--set", "train.seq_len=64", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0", "--set", "checkpoint.every_steps=10", "--set", "retry.in_place=2", "--set",
        "env.HPC_TRAIN_INJECT_FAULT=slow:0:1000", "--set", "env.HPC_TRAIN_INJECT_FAULT_IN_PLACE=0"]


def _run(work: Path, steps: int, standby: bool) -> dict[str, float]:
    keys = ["--set", f"train.steps={steps}", "--set", f"retry.standby={str(standby).lower()}"]
    submitted = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                                *BASE, *keys, "--no-follow"], cwd=work, capture_output=True, text=True, timeout=300,
                               check=True)
    (job_id,) = re.findall(r"submitted job (\d+)", submitted.stdout)
    run_dir = work / "runs" / "tiny-gpt"
    wait(f"step {KILL_AFTER_STEP}", lambda: last_logged_step(run_dir) >= KILL_AFTER_STEP, job_id, run_dir)
    if standby:
        wait("ready standbys", lambda: all(READY in rank_log_text(run_dir, r) for r in (0, 1)), job_id, run_dir)
    killed_at_step = last_logged_step(run_dir)
    killed = time.time()
    os.kill(rank_pid(job_id, 1), signal.SIGKILL)
    wait("end", lambda: state(job_id) == "COMPLETED" and (run_dir / "train.json").exists(), job_id, run_dir)
    metrics = {r["step"]: r["time"] for r in records(run_dir / "metrics.jsonl") if "loss" in r}
    attempts = records(run_dir / "attempts.jsonl")
    opened, resumed = attempts[1]["started"], attempts[1]["start_step"]
    from_standby = "started from standby processes" in rank_log_text(run_dir, 1)
    if from_standby != standby:
        raise SystemExit(f"job {job_id}: standby ranks {'not ' if standby else ''}used; see {run_dir}/logs")
    return {"to_next_life": opened - killed, "to_first_step": metrics[resumed + 1] - opened,
            "total": metrics[resumed + 1] - killed, "lost": killed_at_step - resumed,
            "warm": float(WARM in rank_log_text(run_dir, 0))}  # rank 0 went on in its own process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="one run of each path, 30 steps")
    args = parser.parse_args()
    runs, steps = (1, 30) if args.smoke else (args.runs, args.steps)
    print(machine().line(), flush=True)
    results: dict[str, list[dict[str, float]]] = {"standby": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="hpc_train-standby-") as tmp:
        for run in range(runs):  # alternated, so that a slower moment of the machine falls on both
            for name in results:
                work = Path(tmp) / f"{name}-{run}"
                work.mkdir()
                results[name].append(_run(work, steps, name == "standby"))
    print(f"{'path':<8} {'kill to next life s':>20} {'to its first step s':>20} {'total s':>8} {'steps lost':>10} "
          f"{'rank 0 warm':>11}")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<8} {r['to_next_life']:>20.2f} {r['to_first_step']:>20.2f} {r['total']:>8.2f} "
                  f"{r['lost']:>10.0f} {'yes' if r['warm'] else 'no':>11}")
    for name, rows in results.items():
        print(f"{name}: kill -9 to the next first step {spread([r['total'] for r in rows]).text(2)} s")
    median = {name: statistics.median(r["total"] for r in rows) for name, rows in results.items()}
    print(f"kill -9 to the next first step (medians), standby / cold: {median['standby'] / median['cold']:.3f} "
          f"({median['standby']:.2f} s against {median['cold']:.2f} s; target <= 2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
