"""DeepSpeed's pipeline engine on our GPT follows one unsharded process step for step.

Each case trains the tiny GPT for 6 optimizer steps (fp32, torch AdamW, the ``lr_at`` schedule, gradient
clipping that really clips) on real gloo ranks, and one plain process trains ``GPT(config, None, seed)`` with
torch's AdamW on the same global batches. Compared: every weight before training (bit-identical), DeepSpeed's
groups against our Topology's, the loss of every step (identical on every rank), the gradient norm DeepSpeed
clips with on every rank, and evaluation losses after steps 3 and 6.

Tolerance: 1e-5 absolute on losses and evaluation losses, 1e-5 relative on gradient norms. The ranks sum in
another order than the single process; measured: at most 4.8e-7 on losses, 9.6e-7 relative on norms, 7.2e-7 on
evaluation losses. A gradient norm that leaves out the later stages' LayerNorms is off by about 1.3% and moves
the losses by 2e-4, so the bound catches it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from hpc_train.common.topology import Topology
from tests.rank.distributed.multiproc import run_workers

TOLERANCE = 1e-5
STEPS = 6
SEED = 1234
EVAL_SEED = SEED + 7919
EVAL_MICRO_BATCHES = 2
EVAL_AFTER = (3, STEPS)  # evaluating mid-run must not disturb training
SHAPE = {"vocab_size": 256, "seq_len": 32, "layers": 2, "heads": 4, "hidden": 128}


def _job(zero_stage: int) -> Any:
    """A resolved job config (``plan.config``): fp32, torch AdamW, warm-up then cosine, clipping at 0.5."""
    from hpc_train.config.job import JobConfig
    from hpc_train.config.loader import build

    return build(JobConfig, {
        "train": {"model": "tiny", "steps": STEPS, "seq_len": SHAPE["seq_len"], "micro_batch": 2, "grad_accum": 2,
                  "precision": "fp32", "optimizer": "torch_adamw", "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 2,
                  "decay": "cosine", "weight_decay": 0.1, "grad_clip": 0.5, "seed": SEED},
        "zero": {"stage": zero_stage}, "data": {"source": "synthetic", "vocab_size": SHAPE["vocab_size"]}})


def _param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as the trainer's engine does."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _batches(seed: int, dp_rank: int, dp_size: int, micro_batch: int) -> Iterator[tuple[Any, Any]]:
    """This data-parallel rank's micro-batches, as the trainer draws them."""
    from hpc_train.rank.train.data import ResumableSampler, SyntheticTokens, batch

    source = SyntheticTokens(SHAPE["vocab_size"], SEED)
    sampler = ResumableSampler(source.num_samples(SHAPE["seq_len"]), dp_rank, dp_size, micro_batch, seed=seed)
    while True:
        yield batch(source, sampler.next_indices(), SHAPE["seq_len"])


def _pipeline_worker(rank: int, world_size: int, tp: int, pp: int, job: Any) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    import torch
    from deepspeed.runtime.utils import clip_grad_norm_

    from hpc_train.rank.distributed.mesh import ParallelGroups
    from hpc_train.rank.train.engine import deepspeed_config, lr_at
    from hpc_train.rank.train.model import GPT, GPTConfig
    from hpc_train.rank.train.pipeline import build_pipeline_model, eval_step, gpt_parameter_name, train_step

    config = GPTConfig(**SHAPE)
    topology = Topology.build(world_size, tp=tp, pp=pp)
    groups = ParallelGroups(topology)
    model = build_pipeline_model(config, topology, groups.group("tp"), SEED)
    full = dict(GPT(config, groups.group("tp"), SEED).named_parameters())
    names = [gpt_parameter_name(name, config.layers) for name, _ in model.named_parameters()]
    different = [name for name, (_, param) in zip(names, model.named_parameters(), strict=True)
                 if not torch.equal(param, full[name])]

    train = job.train
    ds = deepspeed_config(job, topology.sizes["dp"])
    ds["zero_allow_untested_optimizer"] = True
    optimizer = torch.optim.AdamW(_param_groups(model, train.weight_decay), lr=train.lr,
                                  betas=(train.beta1, train.beta2), eps=train.eps)

    def schedule(basic: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(basic, lambda step: lr_at(step, train) / train.lr)

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, lr_scheduler=schedule)
    clip_norms: list[float] = []
    if not job.zero.stage:  # ZeRO-0 fp32 clips but keeps no norm: record the one it clips with
        def clip_and_record() -> None:
            clip_norms.append(float(clip_grad_norm_(parameters=engine.module.parameters(),
                                                    max_norm=engine.gradient_clipping(), mpu=engine.mpu)))
        engine.clip_fp32_gradients = clip_and_record

    batches = _batches(SEED, groups.coord("dp"), groups.size("dp"), train.micro_batch)
    losses, norms, eval_losses = [], [], []
    for step in range(1, STEPS + 1):
        losses.append(train_step(engine, batches))
        norms.append(clip_norms[step - 1] if not job.zero.stage else float(engine.get_global_grad_norm()))
        if step in EVAL_AFTER:
            eval_batches = _batches(EVAL_SEED, groups.coord("dp"), groups.size("dp"), train.micro_batch)
            eval_losses.append(eval_step(engine, eval_batches, micro_batches=EVAL_MICRO_BATCHES))
    grid = engine.grid
    return {"losses": losses, "norms": norms, "eval_losses": eval_losses, "different": different,
            "parameters": len(names), "parts": [int(part) for part in model.parts], "stage": grid.get_stage_id(),
            "groups": {"dp": sorted(grid.dp_group), "pp": sorted(grid.pp_group), "tp": sorted(grid.slice_group)}}


def _reference(job: Any, dp: int) -> dict[str, Any]:
    """One plain process, the whole global batch per micro-batch: the trajectory every layout must follow."""
    import torch

    from hpc_train.rank.train.engine import lr_at
    from hpc_train.rank.train.model import GPT, GPTConfig

    train = job.train
    model = GPT(GPTConfig(**SHAPE), None, SEED)
    optimizer = torch.optim.AdamW(_param_groups(model, train.weight_decay), lr=train.lr,
                                  betas=(train.beta1, train.beta2), eps=train.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, train) / train.lr)
    batches = _batches(SEED, 0, 1, train.micro_batch * dp)
    losses, norms, eval_losses = [], [], []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(train.grad_accum):
            loss = model(*next(batches))
            (loss / train.grad_accum).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)))
        optimizer.step()
        scheduler.step()
        losses.append(total / train.grad_accum)
        if step in EVAL_AFTER:
            eval_batches = _batches(EVAL_SEED, 0, 1, train.micro_batch * dp)
            with torch.no_grad():
                eval_losses.append(sum(float(model(*next(eval_batches)))
                                       for _ in range(EVAL_MICRO_BATCHES)) / EVAL_MICRO_BATCHES)
    return {"losses": losses, "norms": norms, "eval_losses": eval_losses}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "tp", "pp", "zero_stage"), [
    pytest.param(2, 1, 2, 0, id="pp2-zero0"),
    # 2 stages at ZeRO-1 with data parallelism: the trainer's pp2 layout (tests/rank/train/test_trainer_layouts.py)
    pytest.param(8, 2, 2, 0, id="tp2-dp2-pp2-zero0"),
])
def test_pipeline_follows_one_process(world: int, tp: int, pp: int, zero_stage: int) -> None:
    job = _job(zero_stage)
    topology = Topology.build(world, tp=tp, pp=pp)
    results = run_workers(partial(_pipeline_worker, tp=tp, pp=pp, job=job), world, timeout_s=300)
    reference = _reference(job, topology.sizes["dp"])

    for rank, result in enumerate(results):
        coords = topology.coords(rank)
        assert result["stage"] == coords["pp"]
        assert result["groups"] == {axis: topology.group_of(rank, axis) for axis in ("dp", "pp", "tp")}, rank
        assert result["parts"] == [0, 2, 4]  # embedding + block 0 | block 1 + head: balanced by parameters
        assert result["different"] == [], f"rank {rank}: weights differ from GPT's: {result['different']}"
        assert result["losses"] == results[0]["losses"], f"rank {rank} reports another loss than rank 0"
        assert result["eval_losses"] == results[0]["eval_losses"]
    stages = [results[topology.rank_of(pp=stage)]["parameters"] for stage in range(pp)]
    assert sum(stages) == 5 + 12 * SHAPE["layers"]  # each of GPT's parameters on exactly one stage
    assert max(reference["norms"]) > job.train.grad_clip, "clipping must act for the norms to matter"

    losses, norms = results[0]["losses"], results[0]["norms"]
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True))
    norm_diff = max(abs(a - b) / b for a, b in zip(norms, reference["norms"], strict=True))
    eval_diff = max(abs(a - b) for a, b in zip(results[0]["eval_losses"], reference["eval_losses"], strict=True))
    detail = f"\npipeline  {losses}\nreference {reference['losses']}\n{norms}\n{reference['norms']}"
    print(f"max |loss diff| {loss_diff:.2e}, max rel norm diff {norm_diff:.2e}, eval diff {eval_diff:.2e}")
    assert loss_diff < TOLERANCE, f"max |loss - reference| = {loss_diff:.2e}{detail}"
    assert norm_diff < TOLERANCE, f"max relative gradient norm difference = {norm_diff:.2e}{detail}"
    assert eval_diff < TOLERANCE, f"max |eval loss - reference| = {eval_diff:.2e}"
    for rank, result in enumerate(results):  # every stage's clipping used the whole model's norm
        assert max(abs(a - b) / b for a, b in zip(result["norms"], reference["norms"], strict=True)) < TOLERANCE, rank
    assert losses[-1] < losses[0]


def test_deepspeed_topology_matches_ours_or_refuses() -> None:
    from hpc_train.rank.train.pipeline import deepspeed_topology

    for order in ("tp-cp-dp-pp", "cp-tp-dp-pp", "tp-dp-cp-pp", "tp-dp-pp-cp"):  # cp = 1 may sit anywhere
        topology = Topology.build(16, tp=2, pp=4, order=order)
        ds = deepspeed_topology(topology)
        for axis, name in (("tp", "model"), ("dp", "data"), ("pp", "pipe")):
            assert sorted(ds.get_axis_comm_lists(name)) == topology.groups(axis)
    deepspeed_topology(Topology.build(8, tp=1, pp=2, order="dp-tp-cp-pp"))  # tensor size 1: same layout
    with pytest.raises(ValueError, match="tensor innermost, then data, then pipeline"):
        deepspeed_topology(Topology.build(8, tp=2, pp=2, order="dp-tp-cp-pp"))
    with pytest.raises(ValueError, match="tensor innermost"):
        deepspeed_topology(Topology.build(8, tp=2, pp=2, order="tp-cp-pp-dp"))
    with pytest.raises(ValueError, match="context parallelism"):
        deepspeed_topology(Topology.build(8, tp=2, pp=2, cp=2))


def test_gpt_parameter_name() -> None:
    from hpc_train.rank.train.pipeline import gpt_parameter_name

    assert gpt_parameter_name("0.wte.weight", 2) == "wte.weight"
    assert gpt_parameter_name("2.mlp.fc.bias", 2) == "blocks.1.mlp.fc.bias"
    assert gpt_parameter_name("3.head.weight", 2) == "head.weight"
    for bad in ("4.head.weight", "wte.weight", "1"):
        with pytest.raises(ValueError, match="not a parameter"):
            gpt_parameter_name(bad, 2)
