"""hpc_train's training step against a hand-written DeepSpeed loop: same model, data, config, 2 ranks.

    .venv/bin/python benchmarks/trainer_overhead.py [--runs 3] [--steps 110] [--save-every 50] [--raw-steady-heap]
                                                    [--smoke]

hpc_train runs the quick-start example through ``hpc_train.submit`` (local executor, ZeRO-2, ``auto`` precision,
the breakdown and the health checks on); the raw loop builds the same GPT, the same DeepSpeed config, the precision
hpc_train decides for ``auto`` on this CPU and AdamW, and feeds the same batches, with nothing else. Both time the
steps after the first 10 (DeepSpeed warms up); runs alternate. Two comparisons: the steps alone (no saves on
either side), then with a save every ``--save-every`` steps on both (hpc_train's checkpoints against DeepSpeed's
``save_checkpoint`` in the raw loop, as its user would save). Target: ratio <= 1.01.

hpc_train's ranks fix glibc's mmap and trim thresholds (``hpc_train/rank/runtime/malloc.py``); the raw loop runs
with glibc's defaults, as a hand-written loop does, unless ``--raw-steady-heap`` gives it the same thresholds (the
library alone with the same allocator settings).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpc_train.bench.local_ranks import free_port
from hpc_train.bench.machine import machine, spread
from hpc_train.rank.runtime.malloc import MMAP_THRESHOLD, TRIM_THRESHOLD
from hpc_train.run.node_log import rank_log_text

REPO = Path(__file__).resolve().parent.parent
WARMUP = 10
# --smoke: 1 untimed step, 1 rank (the same path on both sides at half the processes), the learning rate warmed
# up for 1 step (the example's 20 would need 20 steps)
SMOKE_WARMUP, SMOKE_RANKS, SMOKE_SETS = 1, 1, ["train.warmup_steps=1"]
RAW_LOOP = """
import json, os, sys, time, dataclasses
import torch, torch.distributed as dist, deepspeed
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build, load_toml
from hpc_train.config.overrides import apply_overrides
from hpc_train.rank.train.data import ResumableSampler, SyntheticTokens, batch
from hpc_train.config.deepspeed import deepspeed_config
from hpc_train.rank.train.engine import weight_decay_groups, lr_at
from hpc_train.rank.train.model import GPT, GPTConfig
steps, warmup, save_every = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
config = build(JobConfig, apply_overrides(load_toml(__import__("pathlib").Path(sys.argv[1]), "config"),
                                          [f"train.steps={steps}", *json.loads(sys.argv[4])], JobConfig))
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# As hpc_train does (hpc_train.rank.train.dscomm): no DeepSpeed CPU shm all-reduce, which training never calls, so
# nothing is compiled before the first step (40 s or more on a fresh machine)
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
shm_builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if shm_builder is not None:
    deepspeed.ops.__compatible_ops__[shm_builder.NAME] = False
# The precision hpc_train's ranks decide for "auto" on this hardware (bf16 where the CPU has native bf16, else
# fp32): the same decision, or the two loops would not train the same arithmetic
from hpc_train.config.job import MODEL_PRESETS
from hpc_train.rank.train.precision import agreed_precision
precision, _ = agreed_precision(config.train.precision, torch.device("cpu"),
                                MODEL_PRESETS.get(config.train.model, {}).get("hidden"))
config = dataclasses.replace(config, train=dataclasses.replace(config.train, precision=precision))
train = config.train
model = GPT(GPTConfig.from_preset(train.model, 256, train.seq_len), dist.new_group([rank]), seed=train.seed)
optimizer = torch.optim.AdamW(weight_decay_groups(model, train.weight_decay), lr=train.lr,
                              betas=(train.beta1, train.beta2), eps=train.eps)
ds = deepspeed_config(config, world)
ds["zero_allow_untested_optimizer"] = True
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, lr_scheduler=lambda o:
                                  torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_at(s, train) / train.lr))
source = SyntheticTokens(256, train.seed)
sampler = ResumableSampler(source.num_samples(train.seq_len), rank, world, train.micro_batch, train.seed)
for step in range(steps):
    if step == warmup:
        start = time.perf_counter()
    inputs, targets = batch(source, sampler.next_indices(), train.seq_len)
    loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()
    if save_every and (step + 1) % save_every == 0 and step + 1 < steps:  # as hpc_train: not after the last step
        engine.save_checkpoint("checkpoints", tag=f"step_{step + 1}")  # DeepSpeed's own, synchronous
if rank == 0:
    print(json.dumps({"seconds": time.perf_counter() - start, "steps": steps - warmup, "precision": precision}),
          flush=True)
dist.barrier()  # no rank leaves while another still talks to it (gloo aborted rank 0 at exit once: SIGABRT)
dist.destroy_process_group()
"""


def run_hpc_train(work: Path, steps: int, warmup: int, ranks: int, sets: list[str],
                  save_every: int) -> tuple[float, str]:
    """Seconds per step between the logged steps ``warmup`` and ``steps`` (metrics.jsonl times), and the precision
    the ranks decided (rank 0's log)."""
    extra = [arg for item in (f"job.tasks_per_node={ranks}", f"checkpoint.every_steps={save_every}", *sets)
             for arg in ("--set", item)]
    subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"), "--site",
                    "local", "--set", f"train.steps={steps}", "--set", f"monitor.log_every={warmup}", "--set",
                    "monitor.eval_every=0", "--set", "job.name=overhead", *extra], cwd=work, check=True,
                   capture_output=True)
    records = [json.loads(line) for line in (work / "runs" / "overhead" / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if "time" in r}
    log = rank_log_text(work / "runs" / "overhead", 0)
    decided = re.search(r"precision: (?:auto -> )?(\w+)", log)
    return (times[steps] - times[warmup]) / (steps - warmup), decided.group(1) if decided else "?"


def run_raw(work: Path, steps: int, warmup: int, ranks: int, sets: list[str], save_every: int,
            steady_heap: bool = False) -> tuple[float, str]:
    """Seconds per step of the raw loop; ``steady_heap``: glibc's thresholds as hpc_train's ranks fix them."""
    procs = []
    port = free_port()
    heap = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
    for rank in range(ranks):
        env = {**os.environ, **(heap if steady_heap else {}), "RANK": str(rank), "WORLD_SIZE": str(ranks),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RAW_LOOP, str(REPO / "examples" / "tiny_gpt.toml"),
                                       str(steps), str(warmup - 1), json.dumps(sets), str(save_every)], env=env,
                                      cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"the raw loop failed (exit {[proc.returncode for proc in procs]}): {outputs}")
    result = json.loads([line for line in outputs[0].splitlines() if line.startswith("{")][-1])
    return result["seconds"] / result["steps"], result["precision"]


@dataclass(frozen=True)
class Case:
    """One comparison: both loops with saves every ``save_every`` steps (0: none)."""

    title: str
    save_every: int


def measure(cases: list[Case], runs: int, steps: int, warmup: int, ranks: int, sets: list[str],
            tmp: Path, raw_steady_heap: bool = False) -> tuple[list[dict[str, list[float]]], set[str]]:
    """Seconds per step of each loop in each case, run by run, and the precisions they trained in. The cases
    and the loops take turns (a run of every case, then the next), so that a machine that drifts over the minutes
    of the benchmark drifts under every case alike."""
    results: list[dict[str, list[float]]] = [{"hpc_train": [], "raw DeepSpeed loop": []} for _ in cases]
    precisions: set[str] = set()
    for index in range(runs):
        for case, times in zip(cases, results, strict=True):
            order = list(times) if index % 2 == 0 else list(reversed(times))
            for name in order:
                work = tmp / f"{name.split()[0]}-{case.save_every}-{index}"
                work.mkdir()
                if name == "hpc_train":
                    seconds, precision = run_hpc_train(work, steps, warmup, ranks, sets, case.save_every)
                else:
                    seconds, precision = run_raw(work, steps, warmup, ranks, sets, case.save_every, raw_steady_heap)
                times[name].append(seconds)
                precisions.add(precision)
    return results, precisions


def report(case: Case, results: dict[str, list[float]], tokens_per_step: int) -> None:
    base = statistics.median(results["raw DeepSpeed loop"])
    print(f"{case.title}:")
    print(f"{'path':20} {'s/step':>8} {'tokens/s':>9} {'ratio':>6}")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:20} {median:8.4f} {tokens_per_step / median:9.0f} {median / base:6.3f}")
    paired = [ours / raw for ours, raw in zip(results["hpc_train"], results["raw DeepSpeed loop"], strict=True)]
    print(f"ratio hpc_train / raw DeepSpeed loop, run by run: {spread(paired).text()}; target <= 1.01")
    print(f"raw DeepSpeed loop s/step over runs: {spread(results['raw DeepSpeed loop']).text(4)}")


def _glibc_defaults() -> list[str]:
    """Take the caller's malloc settings out of this process's environment, which both sides inherit: hpc_train's
    ranks would keep them instead of fixing the thresholds, and the report would name the wrong comparison."""
    names = [name for name in os.environ if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES"]
    for name in names:
        del os.environ[name]
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--save-every", type=int, default=50, help="the second comparison's saves (the quick "
                        "start's checkpoint.every_steps); 0 leaves it out")
    parser.add_argument("--raw-steady-heap", action="store_true", help="the raw loop with glibc's mmap and trim "
                        "thresholds fixed as hpc_train's ranks fix them (default: glibc's defaults, as users run it)")
    parser.add_argument("--smoke", action="store_true", help="one run of 3 steps each on 1 rank, with a save: the "
                        "benchmark runs end to end in seconds (CI), its figures mean nothing")
    args = parser.parse_args()
    warmup, ranks, sets = (SMOKE_WARMUP, SMOKE_RANKS, SMOKE_SETS) if args.smoke else (WARMUP, 2, [])
    if args.smoke:
        args.runs, args.steps, args.save_every = 1, SMOKE_WARMUP + 2, 2
    cases = [Case("steps only (no saves on either side)", 0)]
    if args.save_every:
        cases.append(Case(f"with a save every {args.save_every} steps (hpc_train's checkpoint.every_steps; "
                          "DeepSpeed's save_checkpoint in the raw loop)", args.save_every))
    if args.smoke:
        cases = cases[-1:]  # the case with saves runs every path of the other too: CI pays for one pair of runs
    tokens_per_step = 8 * ranks * 128  # the example: micro 8 x data parallel, seq 128
    print(machine().line(), flush=True)  # before the runs: their own load is not counted
    removed = _glibc_defaults()
    if removed:
        print(f"left out of both sides' environment: {', '.join(removed)}")
    with tempfile.TemporaryDirectory() as tmp:
        measured, precisions = measure(cases, args.runs, args.steps, warmup, ranks, sets, Path(tmp),
                                       args.raw_steady_heap)
    if len(precisions) != 1:
        raise SystemExit(f"the two loops trained in different precisions: {precisions}")
    print(f"{args.runs} runs, {args.steps - warmup} timed steps each, tiny GPT, {ranks} rank{'s' * (ranks > 1)}, "
          f"ZeRO-2, {precisions.pop()} (train.precision = auto, decided on this CPU); the raw loop's malloc "
          f"thresholds: {'fixed as hpc_train fixes them' if args.raw_steady_heap else 'glibc defaults'}")
    for case, results in zip(cases, measured, strict=True):
        report(case, results, tokens_per_step)


if __name__ == "__main__":
    main()
