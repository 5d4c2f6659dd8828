"""FSDP2 against DeepSpeed ZeRO-3 in the same trainer: step time and peak memory, same model, data and config.

    .venv/bin/python benchmarks/fsdp2.py [--runs 2] [--steps 40] [--ranks 2 4] [--smoke]

Each run is the quick-start example through ``hpc_train.submit`` on the local executor (fp32, one thread a rank,
the global batch kept at 8 sequences whatever the rank count), once with ``train.engine = "fsdp2"`` and once
with ``zero.stage = 3``; the two alternate, so a machine that drifts hits both. Step time: the median of
``step_time_s`` in ``metrics.jsonl`` after the first 5 steps (the engines warm up). Peak memory: the largest
``memory_bytes`` rank 0 logged (``torch.cuda.max_memory_allocated`` on a GPU, the process's peak resident set
on a CPU, which counts the Python process and its libraries too). Ratios are FSDP2 over ZeRO-3: below 1 is
FSDP2 faster or smaller.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP = 5
GLOBAL_BATCH = 8
ENGINES = {"fsdp2": ["train.engine=fsdp2"], "zero3": ["zero.stage=3"]}


def run_once(work: Path, engine: str, ranks: int, steps: int) -> tuple[float, int]:
    """One training run; (median step seconds after the warm-up, rank 0's peak memory bytes)."""
    sets = [f"train.steps={steps}", "train.precision=fp32", "train.seq_len=64", f"job.tasks_per_node={ranks}",
            f"train.micro_batch={GLOBAL_BATCH // ranks}", "monitor.log_every=1", "monitor.eval_every=0",
            "checkpoint.every_steps=0", "train.warmup_steps=2", "job.cpus_per_task=1", *ENGINES[engine]]
    command = [sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"), "--site",
               "local", *(arg for item in sets for arg in ("--set", item))]
    result = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=900, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{engine} on {ranks} ranks failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (work / "runs" / "tiny-gpt" / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [r for r in records if "step_time_s" in r]
    timed = [r["step_time_s"] for r in steps_seen if r["step"] > min(WARMUP, steps - 1)]
    memory = max((r.get("memory_bytes") or 0) for r in steps_seen)
    return statistics.median(timed), memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each engine at each rank count")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 1 run, 7 steps: the path, not the figures")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.steps, args.ranks = 1, WARMUP + 2, [2]
    print(f"{args.runs} run(s) of {args.steps} steps each, tiny GPT, fp32, global batch {GLOBAL_BATCH}")
    print(f"{'ranks':>5} {'engine':>7} {'step ms':>9} {'ratio':>6} {'peak MiB':>9} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="hpc_train-fsdp2-bench-") as tmp:
        for ranks in args.ranks:
            found: dict[str, list[tuple[float, int]]] = {name: [] for name in ENGINES}
            for index in range(args.runs):
                order = list(ENGINES) if index % 2 == 0 else list(ENGINES)[::-1]
                for engine in order:
                    work = Path(tmp) / f"{ranks}-{engine}-{index}"
                    work.mkdir()
                    found[engine].append(run_once(work, engine, ranks, args.steps))
            base_time = statistics.median(t for t, _ in found["zero3"])
            base_memory = max(m for _, m in found["zero3"])
            for engine in ("zero3", "fsdp2"):
                seconds = statistics.median(t for t, _ in found[engine])
                memory = max(m for _, m in found[engine])
                print(f"{ranks:>5} {engine:>7} {1000 * seconds:>9.1f} {seconds / base_time:>6.3f} "
                      f"{memory / 2**20:>9.1f} {memory / base_memory if base_memory else 0:>6.3f}")


if __name__ == "__main__":
    main()
