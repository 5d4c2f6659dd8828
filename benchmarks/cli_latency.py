"""Wall time of the login-node commands against a bare interpreter, in the same run.

    .venv/bin/python benchmarks/cli_latency.py [--runs 15] [--smoke]

Each command runs in a fresh interpreter (as a user types it); the figure is the median of --runs runs after
one warm-up. Target: every command under 0.5 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")
COMMANDS = {
    "python -c pass (baseline)": ["-c", "pass"],
    "submit --help": ["-m", "hpc_train.submit", "--help"],
    "validate": ["-m", "hpc_train", "validate", EXAMPLE, "--site", "local"],
    "submit --dry-run": ["-m", "hpc_train.submit", EXAMPLE, "--site", "local", "--dry-run"],
    "submit --dry-run --json": ["-m", "hpc_train.submit", EXAMPLE, "--site", "local", "--dry-run", "--json"],
    "render --stdout (local-slurm)": ["-m", "hpc_train", "render", EXAMPLE, "--site", "local-slurm", "--stdout"],
}


def _time(argv: list[str], runs: int, cwd: str) -> list[float]:
    subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, check=True)  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="one run of each command: the benchmark runs end to "
                        "end in seconds (CI), its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    with tempfile.TemporaryDirectory() as cwd:
        results = {name: _time(argv, args.runs, cwd) for name, argv in COMMANDS.items()}
    base = statistics.median(results["python -c pass (baseline)"])
    print(f"{'command':32} {'median s':>9} {'p90 s':>7} {'x bare python':>14} {'under 0.5 s':>12}")
    for name, times in results.items():
        median = statistics.median(times)
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        print(f"{name:32} {median:9.3f} {p90:7.3f} {median / base:14.1f} {'yes' if median < 0.5 else 'NO':>12}")


if __name__ == "__main__":
    main()
