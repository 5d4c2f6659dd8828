"""Your own model in the trainer, measured against what it replaces, in the same run.

    .venv/bin/python benchmarks/user_model.py [--only overhead|data] [--runs 3] [--steps 60] [--smoke]

overhead: the HF GPT-2 example (``examples/hf_gpt2``: a user factory and dataset through hpc_train's
DataLoader stream, 2 ranks, ZeRO-2, fp32) through ``hpc_train.submit`` on the local executor, against a raw
DeepSpeed loop of the same model, the same dataset and DeepSpeed config, a plain ``DataLoader`` over each
rank's slice and nothing else. Both time the steps after the first 10. Target: ratio <= 1.03.

data: a data-bound job, a small model on a dataset whose items each take ``--item-ms`` to read (a sleep, as a
slow file system does), with ``data.num_workers`` 0 against 2: the share of step time spent waiting for data,
taken against the same job on a dataset that costs nothing (the compute-only step time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpc_train.bench.local_ranks import free_port

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "hf_gpt2"
WARMUP = 10


@dataclass(frozen=True)
class Shape:
    """What --smoke changes: untimed steps at the start of every job, ranks, and --set overrides of every job."""

    warmup: int = WARMUP
    ranks: int = 2
    sets: tuple[str, ...] = ()


# One rank: the same path on both sides at half the processes; the learning rate warms up for 1 step (the
# example's 10 would need 10 steps).
SMOKE, SMOKE_RUNS, SMOKE_STEPS = Shape(warmup=1, ranks=1, sets=("train.warmup_steps=1",)), 1, 3
RAW_LOOP = """
import json, sys, time
import torch, torch.distributed as dist, deepspeed
sys.path.insert(0, sys.argv[4])
import gpt2
from types import SimpleNamespace
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build, load_toml
from hpc_train.config.overrides import apply_overrides
from hpc_train.config.deepspeed import deepspeed_config
from hpc_train.rank.train.engine import weight_decay_groups, lr_at
steps, warmup = int(sys.argv[2]), int(sys.argv[3])
overrides = [f"train.steps={steps}", "train.precision=fp32", f"data.path={sys.argv[5]}", *json.loads(sys.argv[6])]
config = build(JobConfig, apply_overrides(load_toml(__import__("pathlib").Path(sys.argv[1]), "config"), overrides,
                                          JobConfig))
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
train = config.train
ctx = SimpleNamespace(params=dict(config.params), config=config)
torch.manual_seed(train.seed)
model = gpt2.model(ctx)
optimizer = torch.optim.AdamW(weight_decay_groups(model, train.weight_decay), lr=train.lr,
                              betas=(train.beta1, train.beta2), eps=train.eps)
ds = deepspeed_config(config, world)
ds["zero_allow_untested_optimizer"] = True
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, lr_scheduler=lambda o:
                                  torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_at(s, train) / train.lr))
data = gpt2.dataset(ctx, "train")
mine = torch.utils.data.Subset(data, range(rank, len(data), world))
loader = torch.utils.data.DataLoader(mine, batch_size=train.micro_batch, shuffle=True, drop_last=True)
batches = iter(loader)
for step in range(steps):
    if step == warmup:
        start = time.perf_counter()
    batch = next(batches, None)
    if batch is None:  # the next epoch
        batches = iter(loader)
        batch = next(batches)
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
if rank == 0:
    print(json.dumps({"seconds": time.perf_counter() - start, "steps": steps - warmup}))
"""
DATA_BOUND = '''
import time
import torch


class Slow(torch.utils.data.Dataset):
    """Item i costs item_ms to read."""

    def __init__(self, item_ms: float) -> None:
        self.item_s = item_ms / 1000

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int):
        if self.item_s:
            time.sleep(self.item_s)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(64, generator=generator), torch.tensor(index % 4)


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 4))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y)


def model(ctx):
    return Classifier()


def dataset(ctx, split):
    return Slow(ctx.params["item_ms"])
'''


def _seconds_per_step(run_dir: Path, steps: int, shape: Shape) -> float:
    """Seconds per step between the logged steps ``shape.warmup`` and ``steps`` (metrics.jsonl times)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if "time" in r}
    return (times[steps] - times[shape.warmup]) / (steps - shape.warmup)


def _submit(work: Path, config: Path, steps: int, shape: Shape, *sets: str) -> Path:
    args = [arg for item in (f"train.steps={steps}", f"monitor.log_every={shape.warmup}", "monitor.eval_every=0",
                             "checkpoint.every_steps=0", "job.name=bench", f"job.tasks_per_node={shape.ranks}",
                             *shape.sets, *sets) for arg in ("--set", item)]
    subprocess.run([sys.executable, "-m", "hpc_train.submit", str(config), "--site", "local", *args], cwd=work,
                   check=True, capture_output=True)
    return work / "runs" / "bench"


def run_hpc_train(work: Path, tokens: Path, steps: int, shape: Shape) -> float:
    return _seconds_per_step(_submit(work, EXAMPLE / "job.toml", steps, shape, "train.precision=fp32",
                                     f"data.path={tokens}", "data.num_workers=0"), steps, shape)


def run_raw(work: Path, tokens: Path, steps: int, shape: Shape) -> float:
    port = free_port()
    procs = []
    for rank in range(shape.ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(shape.ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RAW_LOOP, str(EXAMPLE / "job.toml"), str(steps),
                                       str(shape.warmup), str(EXAMPLE), str(tokens), json.dumps(shape.sets)],
                                      cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True))
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"the raw loop failed: {outputs}")
    result = json.loads(outputs[0].strip().splitlines()[-1])
    return float(result["seconds"]) / int(result["steps"])


def overhead(runs: int, steps: int, shape: Shape) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "corpus.u16"
        subprocess.run([sys.executable, "-m", "hpc_train.login.prepare", str(REPO / "examples" / "corpus" /
                        "hpc_train_docs.txt"), str(tokens)], check=True, capture_output=True)
        ours, raw = [], []
        for index in range(runs):  # alternate, so that a busy moment does not favour one side
            with tempfile.TemporaryDirectory() as work:
                ours.append(run_hpc_train(Path(work), tokens, steps, shape))
            with tempfile.TemporaryDirectory() as work:
                raw.append(run_raw(Path(work), tokens, steps, shape))
            print(f"run {index + 1}: hpc_train {ours[-1] * 1000:.2f} ms/step, raw DeepSpeed {raw[-1] * 1000:.2f} "
                  f"ms/step, ratio {ours[-1] / raw[-1]:.3f}")
    mine, theirs = statistics.median(ours), statistics.median(raw)
    print(f"median: hpc_train {mine * 1000:.2f} ms/step, raw DeepSpeed loop {theirs * 1000:.2f} ms/step, "
          f"ratio {mine / theirs:.3f} (target <= 1.03)")


def data_bound(runs: int, steps: int, item_ms: float, shape: Shape) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        code = Path(tmp) / "bench_data.py"
        code.write_text(DATA_BOUND)
        config = Path(tmp) / "job.toml"
        config.write_text('[job]\ntasks_per_node = 2\n[train]\nmodel = "bench_data.py:model"\nmicro_batch = 16\n'
                          'precision = "fp32"\nwarmup_steps = 2\n[data]\nsource = "bench_data.py:dataset"\n')

        def step_s(item: float, workers: int) -> float:
            sets = [f"params.item_ms={item}", f"data.num_workers={workers}"]
            if workers:
                sets.append("data.persistent_workers=true")
            with tempfile.TemporaryDirectory() as work:
                return _seconds_per_step(_submit(Path(work), config, steps, shape, *sets), steps, shape)

        for index in range(runs):
            compute = step_s(0.0, 0)
            line = [f"run {index + 1}: compute only {compute * 1000:.1f} ms/step"]
            for workers in (0, 2):
                seconds = step_s(item_ms, workers)
                line.append(f"num_workers={workers} {seconds * 1000:.1f} ms/step, waiting for data "
                            f"{max(0.0, 1 - compute / seconds):.0%}")
            print("; ".join(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("overhead", "data"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--item-ms", type=float, default=1.0, help="data: the cost of one item (a sleep)")
    parser.add_argument("--smoke", action="store_true", help=f"one run of {SMOKE_STEPS} steps per job, "
                        f"{SMOKE.ranks} rank: the benchmark runs end to end in seconds (CI), its figures mean nothing")
    args = parser.parse_args()
    shape = SMOKE if args.smoke else Shape()
    if args.smoke:
        args.runs, args.steps = SMOKE_RUNS, SMOKE_STEPS
    if args.only in (None, "overhead"):
        overhead(args.runs, args.steps, shape)
    if args.only in (None, "data"):
        data_bound(args.runs, args.steps, args.item_ms, shape)


if __name__ == "__main__":
    main()
