"""hpc_train's training step against a hand-written DeepSpeed loop: same model, data, config, 2 ranks.

    .venv/bin/python benchmarks/trainer_overhead.py [--runs 3] [--steps 110]

hpc_train runs the quick-start example through ``hpc_train.submit`` (local executor, ZeRO-2, bf16); the raw
loop builds the same GPT, the same DeepSpeed config and AdamW, and feeds the same batches, with nothing else.
Both time the steps after the first 10 (DeepSpeed warms up); runs alternate. Target: ratio <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP = 10
RAW_LOOP = """
import json, os, sys, time, dataclasses
import torch, torch.distributed as dist, deepspeed
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build, load_toml
from hpc_train.config.overrides import apply_overrides
from hpc_train.train.data import ResumableSampler, SyntheticTokens, batch
from hpc_train.config.deepspeed import deepspeed_config
from hpc_train.train.engine import weight_decay_groups, lr_at
from hpc_train.train.model import GPT, GPTConfig
steps, warmup = int(sys.argv[2]), int(sys.argv[3])
config = build(JobConfig, apply_overrides(load_toml(__import__("pathlib").Path(sys.argv[1]),
                                                             "config"), [f"train.steps={steps}"], JobConfig))
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
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
if rank == 0:
    print(json.dumps({"seconds": time.perf_counter() - start, "steps": steps - warmup}))
"""


def run_hpc_train(work: Path, steps: int) -> float:
    """Seconds per step between the logged steps WARMUP and ``steps`` (metrics.jsonl times)."""
    subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"), "--site",
                    "local", "--set", f"train.steps={steps}", "--set", f"monitor.log_every={WARMUP}", "--set",
                    "monitor.eval_every=0", "--set", "job.name=overhead"], cwd=work, check=True,
                   capture_output=True)
    records = [json.loads(line) for line in (work / "runs" / "overhead" / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if "time" in r}
    return (times[steps] - times[WARMUP]) / (steps - WARMUP)


def run_raw(work: Path, steps: int) -> float:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RAW_LOOP, str(REPO / "examples" / "tiny_gpt.toml"),
                                       str(steps), str(WARMUP - 1)], env=env, cwd=work, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    result = json.loads([line for line in outputs[0].splitlines() if line.startswith("{")][-1])
    return result["seconds"] / result["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=110)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"hpc_train": [], "raw DeepSpeed loop": []}
    tokens_per_step = 16 * 128  # the example: micro 8 x data 2, seq 128
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.runs):
            order = list(results) if index % 2 == 0 else list(reversed(results))
            for name in order:
                work = Path(tmp) / f"{name.split()[0]}-{index}"
                work.mkdir()
                runner = run_hpc_train if name == "hpc_train" else run_raw
                results[name].append(runner(work, args.steps))
    base = statistics.median(results["raw DeepSpeed loop"])
    print(f"{args.runs} runs, {args.steps - WARMUP} timed steps each, tiny GPT, 2 ranks, ZeRO-2, bf16")
    print(f"{'path':20} {'s/step':>8} {'tokens/s':>9} {'ratio':>6}")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:20} {median:8.4f} {tokens_per_step / median:9.0f} {median / base:6.3f}")


if __name__ == "__main__":
    main()
