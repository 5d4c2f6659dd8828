"""What one ``ctx.log(step, loss=tensor)`` costs rank 0, against a loop that writes its own metrics file.

hpc_train's side is the monitor's record path of a ``ctx.log`` program: ``Monitor.scalars`` keeping the record
(the tensor copied), and at every ``log_every`` steps the flush (the records' lines, the health checks over them,
one write), TensorBoard off. The baseline is what a training loop without hpc_train does to keep the same file:
``json.dumps`` of the record and a write per call. Both in one process, alternated, so the machine's noise hits
both; the figure is microseconds a call and the ratio to the baseline.

    .venv/bin/python benchmarks/log_call.py [--calls 20000] [--rounds 5] [--smoke]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from hpc_train.rank.runtime.health import HealthCheck, RecordHealth, Thresholds
from hpc_train.rank.runtime.monitor import Monitor


def _hpc_train(folder: Path, calls: int) -> float:
    def consumers() -> list[RecordHealth]:
        return [RecordHealth(HealthCheck(folder, Thresholds(0.3, 3.0, 0.1, -1, 0.2), lambda line: None), every=10)]

    monitor = Monitor.create(0, folder, total_steps=0, log_every=10, tensorboard=False, start_step=0,
                             console=Console(file=io.StringIO(), width=200), exporters=consumers)
    value = torch.tensor(1.5)
    began = time.perf_counter()
    for step in range(1, calls + 1):
        monitor.scalars(step, {"loss": value})
    seconds = time.perf_counter() - began
    monitor.close()
    return seconds / calls


def _baseline(folder: Path, calls: int) -> float:
    value = torch.tensor(1.5)
    with (folder / "own.jsonl").open("a") as sink:
        began = time.perf_counter()
        for step in range(1, calls + 1):
            sink.write(json.dumps({"step": step, "loss": float(value), "time": time.time()}) + "\n")
        seconds = time.perf_counter() - began
    return seconds / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="2,000 calls, one round")
    args = parser.parse_args()
    calls, rounds = (2_000, 1) if args.smoke else (args.calls, args.rounds)
    ours, theirs = [], []
    for index in range(rounds):
        with tempfile.TemporaryDirectory(prefix="hpc_train-logcall-") as tmp:
            first, second = Path(tmp) / "a", Path(tmp) / "b"
            first.mkdir()
            second.mkdir()
            if index % 2:  # alternate which goes first
                theirs.append(_baseline(second, calls))
                ours.append(_hpc_train(first, calls))
            else:
                ours.append(_hpc_train(first, calls))
                theirs.append(_baseline(second, calls))
    mine, base = statistics.median(ours), statistics.median(theirs)
    print(f"{rounds} round(s) x {calls:,} calls, one tensor a call, log_every 10, TensorBoard off")
    print(f"{'variant':<40} {'us/call':>8} {'ratio':>6}")
    print(f"{'hpc_train Monitor.scalars + health':<40} {1e6 * mine:8.2f} {mine / base:6.2f}")
    print(f"{'own json.dumps + write (baseline)':<40} {1e6 * base:8.2f} {1.0:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
