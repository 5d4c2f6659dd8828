"""The memory tier on the local Slurm cluster: a rank killed, and a node lost with a spare, each resumed from memory
against the same fault resumed from disk; and what the copies cost a step.

    scripts/local_slurm.sh up && .venv/bin/python benchmarks/memory_restart.py [--runs 3] [--smoke]

Every job trains the tiny GPT on 2 nodes x 1 rank, disk checkpoints every 10 steps, standby ranks on, rank 0 slowed
to ``--slow-ms`` a step so that the fault lands mid-run. ``memory`` copies every 5 steps
(``checkpoint.memory_every_steps = 5``), ``disk`` not at all. Faults, once step 17 is logged (and, with memory, once
the node that loses its rank has sent a copy to the next node):

- ``kill``: rank 1 gets SIGKILL (the agent sees it, every rank starts again in the job);
- ``lost``: a 2-node job with one spare (partition ``spares``, through the rendered srun script); node n2 is
  drained and every process of the job on it killed, as when a node is lost; the spare n3 takes rank 1.

The clock is the run folder's: the fault (this script's), the agents' decision (the log line of the restart), the
next life's line in ``attempts.jsonl``, and the record of its first step in ``metrics.jsonl``; steps lost are the
steps logged before the fault that the next life trains again. ``cost``: two jobs without a fault, memory every
step against none, compared by their median step time (rank 0 unslowed). Targets (issue 42): kill -9 to the next
first step at most 2 s; a lost node with a spare at most 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from slurm_jobs import rank_pid, records, slurm_job_processes, state, wait

from hpc_train.bench.machine import machine, spread
from hpc_train.run.watch import last_logged_step

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
FAULT_AFTER_STEP = 17
BASE = ["--site", "local-slurm", "--set", "job.nodes=2", "--set", "job.tasks_per_node=1", "--set",
        "train.precision=fp32", "--set", "train.seq_len=64", "--set", "monitor.log_every=1", "--set",
        "monitor.eval_every=0", "--set", "checkpoint.every_steps=10", "--set", "retry.in_place=2"]
DECIDED = re.compile(r"^(\S+ \S+) \S+ INFO in-place restart 1 of \d+", re.MULTILINE)
RESUMED = re.compile(r"resumed from memory at step (\d+)")


def _logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log")))


def _submit(work: Path, keys: list[str], lost: bool) -> str:
    if not lost:
        out = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, *BASE, *keys, "--no-follow"],
                             cwd=work, capture_output=True, text=True, timeout=300, check=True).stdout
        return re.findall(r"submitted job (\d+)", out)[0]
    spare = ["--set", "job.spare_nodes=1", "--set", "job.partition=spares"]
    rendered = subprocess.run([sys.executable, "-m", "hpc_train", "render", EXAMPLE, *BASE, *keys, *spare,
                               "--template", "srun", "--json"], cwd=work, capture_output=True, text=True,
                              timeout=60, check=True)
    script = json.loads(rendered.stdout)["script"]
    return subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip().split(";")[0]


def _copied(run_dir: Path) -> bool:
    """Whether node n2's agent has sent rank 1's first copy to another node."""
    return "memory tier: rank 1's step" in _logs(run_dir)


def _lose_n2(job_id: str) -> None:
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=hpc_train-bench-lost-node"],
                   check=True, timeout=30)
    for pid in slurm_job_processes(job_id, "n2"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _fault_run(work: Path, steps: int, memory: bool, lost: bool, slow_ms: int) -> dict[str, float]:
    keys = ["--set", f"train.steps={steps}", "--set", f"checkpoint.memory_every_steps={5 if memory else 0}",
            "--set", f"env.HPC_TRAIN_INJECT_FAULT=slow:0:{slow_ms}", "--set", "env.HPC_TRAIN_INJECT_FAULT_IN_PLACE=0"]
    job_id = _submit(work, keys, lost)
    run_dir = work / "runs" / "tiny-gpt"
    try:
        wait(f"step {FAULT_AFTER_STEP}", lambda: last_logged_step(run_dir) >= FAULT_AFTER_STEP, job_id, run_dir)
        if memory:
            wait("a copy sent to another node", lambda: _copied(run_dir), job_id, run_dir)
        # the holding nodes' standbys (with spares, the agents' lines are in logs/agents-*.log)
        wait("ready standbys", lambda: _logs(run_dir).count("standby rank(s) ready") >= 2, job_id, run_dir)
        at_step, fault = last_logged_step(run_dir), time.time()
        if lost:
            _lose_n2(job_id)
        else:
            os.kill(rank_pid(job_id, 1), signal.SIGKILL)
        wait("end", lambda: state(job_id) == "COMPLETED" and (run_dir / "train.json").exists(), job_id, run_dir)
    finally:
        if lost:
            subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], check=False, timeout=30)
    text = _logs(run_dir)
    metrics = {r["step"]: r["time"] for r in records(run_dir / "metrics.jsonl") if "loss" in r}
    attempts = records(run_dir / "attempts.jsonl")
    opened, resumed = attempts[1]["started"], attempts[1]["start_step"]
    decided = min(datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f").timestamp() for m in DECIDED.findall(text))
    from_memory = RESUMED.search(text)
    if bool(from_memory) != memory:
        raise SystemExit(f"job {job_id}: resumed from {'memory' if from_memory else 'disk'}; see {run_dir}/logs")
    return {"decided": decided - fault, "next_life": opened - fault, "first_step": metrics[resumed + 1] - fault,
            "lost": at_step - resumed, "resumed": resumed}


def _cost_run(work: Path, steps: int, every: int) -> float:
    keys = ["--set", f"train.steps={steps}", "--set", f"checkpoint.memory_every_steps={every}"]
    job_id = _submit(work, keys, lost=False)
    run_dir = work / "runs" / "tiny-gpt"
    wait("end", lambda: state(job_id) == "COMPLETED" and (run_dir / "train.json").exists(), job_id, run_dir)
    times = [r["time"] for r in records(run_dir / "metrics.jsonl") if "loss" in r]
    return statistics.median(b - a for a, b in itertools.pairwise(times[5:]))


def _copy_size_mb(text: str) -> float:
    sizes = [float(m) for m in re.findall(r"memory tier: rank \d+'s step \d+ \(([\d.]+) MB\)", text)]
    return max(sizes) if sizes else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow-ms", type=int, default=500, help="rank 0's extra time a step before the fault")
    parser.add_argument("--smoke", action="store_true", help="one kill from memory and one from disk, 30 steps")
    args = parser.parse_args()
    runs, steps = (1, 30) if args.smoke else (args.runs, args.steps)
    print(machine().line(), flush=True)
    paths = [("kill", False)] if args.smoke else [("kill", False), ("lost", True)]
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="hpc_train-memory-") as tmp:
        for run in range(runs):  # alternated, so that a slower moment of the machine falls on both
            for fault, lost in paths:
                for memory in (True, False):
                    work = Path(tmp) / f"{fault}-{memory}-{run}"
                    work.mkdir()
                    name = f"{fault}/{'memory' if memory else 'disk'}"
                    results.setdefault(name, []).append(_fault_run(work, steps, memory, lost, args.slow_ms))
                    if run == 0 and memory and fault == "kill":
                        size = _copy_size_mb(_logs(work / "runs" / "tiny-gpt"))
        cost = None
        if not args.smoke:
            (Path(tmp) / "cost-1").mkdir()
            (Path(tmp) / "cost-0").mkdir()
            cost = (_cost_run(Path(tmp) / "cost-1", steps, 1), _cost_run(Path(tmp) / "cost-0", steps, 0))
    print(f"{'path':<12} {'to decision s':>14} {'to next life s':>15} {'to first step s':>16} {'steps lost':>10}")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<12} {r['decided']:>14.2f} {r['next_life']:>15.2f} {r['first_step']:>16.2f} "
                  f"{r['lost']:>10.0f}")
    for name, rows in results.items():
        print(f"{name}: fault to the next first step {spread([r['first_step'] for r in rows]).text(2)} s, steps "
              f"lost {spread([r['lost'] for r in rows]).text(0)}")
    print(f"one rank's copy in memory: {size:.1f} MB (a node keeps 3 of each of its ranks and 3 of each replica)")
    if cost is not None:
        with_copies, without = cost
        print(f"step time, a copy every step against none (medians): {with_copies * 1e3:.1f} ms against "
              f"{without * 1e3:.1f} ms: a copy costs {(with_copies - without) * 1e3:.1f} ms, "
              f"{(with_copies - without) / 100 / without * 100:.2f}% of a step at the default memory_every_steps = 100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
