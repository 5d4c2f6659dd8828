"""A rank's start to its first step, and where the time goes: the built-in trainer against the floor that its
libraries' imports set.

    .venv/bin/python benchmarks/rank_start.py [--runs 3] [--smoke]

(a) The import ladder: each module imported after those above it, in a fresh interpreter per run. These are
torch, DeepSpeed, the trainer, and the two compiler modules that torch's optimizer and DeepSpeed's ZeRO import
on their first use. (b) The tiny GPT on one rank of the local executor, from the rank's ``start:`` log line to
its ``step=1`` line, against the floor: the ladder's sum, which any trainer on these libraries pays before its
first step. Prints medians and the ratio. Target (issue 26): at most 3 s from start to first step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from hpc_train.run.node_log import rank_log_text

REPO = Path(__file__).resolve().parent.parent
LADDER = ("torch", "deepspeed", "hpc_train.rank.train.trainer", "torch._dynamo", "torch._inductor.compile_fx")
_LADDER_CODE = """
import importlib, sys, time
for name in sys.argv[1:]:
    start = time.perf_counter()
    importlib.import_module(name)
    print(name, time.perf_counter() - start)
"""


def _ladder() -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _LADDER_CODE, *LADDER], capture_output=True, text=True,
                         timeout=300, check=True, cwd=REPO).stdout
    rows = [line.split() for line in out.splitlines()]  # DeepSpeed prints its accelerator warning here too
    return {row[0]: float(row[1]) for row in rows if len(row) == 2 and row[0] in LADDER}


def _stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _trainer_start(folder: Path) -> float:
    args = ["--site", "local", "--executor", "local", "--set", "job.tasks_per_node=1", "--set", "train.steps=2",
            "--set", "train.warmup_steps=1", "--set", "train.precision=fp32", "--set", "monitor.log_every=1",
            "--set", "monitor.eval_every=0"]
    subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"), *args],
                   cwd=folder, capture_output=True, text=True, timeout=300, check=True)
    lines = rank_log_text(folder / "runs" / "tiny-gpt", 0).splitlines()
    start = next(_stamp(line) for line in lines if " start: " in line)
    return next(_stamp(line) for line in lines if "step=1/" in line) - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one run of each")
    args = parser.parse_args(argv)
    runs = 1 if args.smoke else args.runs
    ladders, starts = [], []
    for run in range(runs):  # alternated, so that the machine's load falls on both sides alike
        ladders.append(_ladder())
        with tempfile.TemporaryDirectory(prefix="rank-start-") as folder:
            starts.append(_trainer_start(Path(folder)))
        imports = sum(ladders[-1].values())
        print(f"run {run + 1}: trainer start to first step {starts[-1]:.2f} s; imports {imports:.2f} s", flush=True)
    print("(a) imports, each after those above it (median s):")
    for name in LADDER:
        print(f"    {name:32s} {statistics.median(ladder[name] for ladder in ladders):6.2f}")
    floor = statistics.median(sum(ladder.values()) for ladder in ladders)
    start = statistics.median(starts)
    print(f"(b) trainer start to first step: median {start:.2f} s; import floor {floor:.2f} s; ratio "
          f"{start / floor:.2f}; target 3 s: {'met' if start <= 3 else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
