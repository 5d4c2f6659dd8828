"""The memory plan: its arithmetic by hand, its import (pure Python, for login nodes), and what DeepSpeed 0.19
really holds on 2 and 4 data-parallel ranks with ZeRO 0-3 in fp32 and bf16.

The real check builds the engine the trainer builds (``build_engine`` on the tiny GPT), runs one step and adds up
the bytes of the distinct storages behind what DeepSpeed keeps: parameters (module parameters; ZeRO-3: the
partitions ``ds_tensor`` and the parameters it keeps whole), gradients (after each backward pass: ``param.grad``,
the ZeRO-1/2 partition buffers ``averaged_gradients`` / ``all_grad_tensors``, ZeRO-3's flat gradient partition
buffer), optimizer state (AdamW's state tensors and the fp32 master copies), the gradient-reduction buffers (ZeRO-0's
all-reduce copy, the ZeRO-1/2 buckets seen from a gradient hook, ZeRO-3's bucket) and the fp32 gradient copy at
the optimizer step. The plan describes the worst rank, so the largest measured rank must be within TOLERANCE of
the plan and no rank above it by more. The plan models DeepSpeed's layout exactly, so the measured figures match
to within a few bytes (AdamW's step counters); the 10 % is headroom for DeepSpeed releases that move padding.

DeepSpeed's first start on a machine JIT-compiles its shared-memory op (about 33 s, then cached in
~/.cache/torch_extensions); later runs of this file take about 35 s on 2 CPU cores.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any

import pytest

from hpc_train.train.memory import MemoryPlan, Param, memory_plan, memory_rows, stage_parameters
from tests.conftest import REPO
from tests.distributed.multiproc import run_workers

TOLERANCE = 0.10
SEQ, MICRO, VOCAB = 64, 2, 256
# (ZeRO stage, precision, grad_accum): every stage in both precisions, and the two accumulation cases that change
# what is held between micro-batches (ZeRO-1 keeps full gradients, ZeRO-2 its partition).
CASES = [(stage, precision, 1) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]
CASES += [(1, "bf16", 2), (2, "fp32", 2)]
FIGURES = ("parameters", "gradients", "optimizer_state", "reduce_buffers", "step_buffers")


# ------------------------------------------------------------------------------------------------------------------
# Pure Python
# ------------------------------------------------------------------------------------------------------------------

def test_imports_no_torch_deepspeed_or_numpy() -> None:
    code = ("import sys, hpc_train.train.memory as m; m.memory_plan('7B', 32000, 4096, 1, 1, 1, 8, 3, 'bf16', "
            "False, False, 80.0); print(sorted({'torch', 'deepspeed', 'numpy'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                            cwd=REPO)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_parameter_count_matches_the_model_for_every_preset() -> None:
    from hpc_train.config.job import MODEL_PRESETS
    from hpc_train.train.model import GPTConfig, count_parameters

    for preset in MODEL_PRESETS:
        planned = sum(p.numel for stage in stage_parameters(preset, 50304, 1024) for p in stage)
        assert planned == count_parameters(GPTConfig.from_preset(preset, 50304, 1024)), preset
        # pipeline stages cut the same parameters, in order
        stages = stage_parameters(preset, 50304, 1024, pipeline=2)
        assert [p for stage in stages for p in stage] == stage_parameters(preset, 50304, 1024)[0]


def test_parameter_shapes_match_the_built_model() -> None:
    from hpc_train.train.model import GPT, GPTConfig

    model = GPT(GPTConfig.from_preset("tiny", VOCAB, SEQ))
    real = [Param(name, p.numel(), p.dim() >= 2) for name, p in model.named_parameters()]
    assert real == stage_parameters("tiny", VOCAB, SEQ)[0]


def test_tensor_parallel_shards_only_the_split_layers() -> None:
    h = 768
    whole = {p.name: p.numel for p in stage_parameters("125M", 50304, 1024)[0]}
    split = {p.name: p.numel for p in stage_parameters("125M", 50304, 1024, tensor=4)[0]}
    assert split["wte.weight"] == split["head.weight"] == 50304 * h // 4
    assert split["blocks.0.attn.qkv.bias"] == 3 * h // 4 and split["blocks.0.mlp.fc.bias"] == 4 * h // 4
    for replicated in ("wpe.weight", "blocks.0.ln1.weight", "blocks.0.attn.proj.bias", "blocks.0.mlp.proj.bias",
                       "ln_f.bias"):
        assert split[replicated] == whole[replicated], replicated
    # per rank: everything but the replicated vectors and the position embedding divides by 4
    replicated = 1024 * h + 12 * (2 * h + 2 * h + h + h) + 2 * h
    assert sum(split.values()) == (sum(whole.values()) - replicated) // 4 + replicated


def test_tiny_zero0_fp32_by_hand() -> None:
    # tiny: V=256, S=128, h=128, L=2.  P = 2*V*h + S*h + L*(12h^2 + 13h) + 2h = 478,720
    plan = memory_plan("tiny", 256, 128, 4, 1, 1, 2, 0, "fp32", False, False)
    assert plan.params_per_rank == 478_720
    assert plan.parameters == plan.gradients == 4 * 478_720 == 1_914_880
    assert plan.optimizer_state == 8 * 478_720  # Adam m, v; ZeRO-0 fp32 steps the module's own weights
    assert plan.reduce_buffers == 4 * 478_720 and plan.step_buffers == 0  # one flat all-reduce copy
    # activations: per layer s*b*h*34 bytes in 16-bit, doubled in fp32: 512*128*34*2 = 4,456,448 x 2 layers;
    # final LayerNorm + head inputs 2 * 512*128*4 = 524,288; logits 512 * 256 * 8 = 1,048,576
    assert plan.activations == 2 * 4_456_448 + 524_288 + 1_048_576 == 10_485_760
    assert plan.total == 1_914_880 * 2 + 3_829_760 + 10_485_760 + 1_914_880
    assert plan.fits is None and plan.cpu == 0


def test_tiny_zero2_bf16_partition_by_hand() -> None:
    # S=64: matrices (flattened first) wte 32768, wpe 8192, per block qkv 49152, proj 16384, fc 65536,
    # mlp.proj 65536, head 32768 = 466,944 -> 233,472 per rank. Rank 0 holds wte..fc of block 0 and the
    # mlp.proj of block 0 that straddles its end (237,568); rank 1 holds that mlp.proj too, and the rest:
    # 65536 + 196,608 + 32,768 = 294,912. Vectors: 3,584 elements, 1,792 per rank, no straddling.
    plan = memory_plan("tiny", 256, 64, 2, 1, 1, 2, 2, "bf16", False, False)
    assert plan.params_per_rank == 470_528
    assert plan.parameters == 2 * 470_528
    assert plan.gradients == 2 * (294_912 + 1_792)
    assert plan.optimizer_state == 12 * 470_528 // 2  # fp32 master 4 + Adam 8 bytes, halved
    assert plan.reduce_buffers == 2 * 50_000_000 * 2  # two buckets with overlap_comm, whatever the model's size
    assert plan.step_buffers == 4 * 233_472  # fp32 copy of the matrices' partition
    assert plan.buffers == plan.reduce_buffers
    single = memory_plan("tiny", 256, 64, 2, 1, 1, 2, 2, "bf16", False, False, overlap_comm=False)
    assert single.reduce_buffers == 50_000_000 * 2


def test_tiny_zero3_keeps_small_parameters_whole() -> None:
    plan = memory_plan("tiny", 256, 128, 4, 1, 1, 2, 3, "bf16", False, False)
    # every tiny parameter has <= 100,000 elements: all stay whole, on top of the partitions (478,720 / 2)
    assert plan.parameters == 2 * (239_360 + 478_720)
    assert plan.gradients == 2 * 239_360 and plan.optimizer_state == 12 * 239_360
    assert plan.reduce_buffers == 50_000_000 * 2  # one bucket for the whole run, nothing to gather
    assert plan.buffers == plan.reduce_buffers + 4 * 475_136 // 2
    assert any("whole on every rank" in note for note in plan.notes)


def test_125m_matches_the_zero_paper() -> None:
    # vocab 50304, S=1024, h=768, L=12: P = 2*50304*768 + 1024*768 + 12*(12*768^2 + 13*768) + 2*768
    p = 77_266_944 + 786_432 + 85_054_464 + 1_536
    assert p == 163_109_376
    base = memory_plan("125M", 50304, 1024, 8, 1, 1, 1, 0, "bf16", False, False)
    assert (base.parameters, base.gradients, base.optimizer_state) == (2 * p, 2 * p, 12 * p)  # 16 bytes/param
    zero3 = memory_plan("125M", 50304, 1024, 8, 1, 1, 8, 3, "bf16", False, False)
    # all tensors divide by 8; only the 121,344 LayerNorm and bias elements stay whole (matrices > 1e5)
    assert zero3.parameters == 2 * (p // 8 + 121_344)
    assert (zero3.gradients, zero3.optimizer_state) == (2 * p // 8, 12 * p // 8)
    zero1 = memory_plan("125M", 50304, 1024, 8, 1, 1, 8, 1, "bf16", False, False)
    assert zero1.optimizer_state == 12 * p // 8 and zero1.parameters == 2 * p
    # the 38.6M-element embedding straddles a boundary of the 20.4M-element partitions, so up to 2x is held
    assert 2 * p // 8 < zero1.gradients <= 2 * (p // 8 + 2 * 50304 * 768)
    # activations: 8192 tokens * 768 * 34 * 12 layers + 2 * 8192 * 768 * 2 + 8192 * 50304 * 10
    assert base.activations == 2_566_914_048 + 25_165_824 + 4_120_903_680


def test_tensor_parallel_divides_activations() -> None:
    one = memory_plan("1.3B", 50304, 2048, 1, 1, 1, 1, 0, "bf16", False, False)
    four = memory_plan("1.3B", 50304, 2048, 1, 4, 1, 1, 0, "bf16", False, False)
    sbh = 2048 * 1 * 2048
    head_inputs = 2 * sbh * 2  # final LayerNorm and head inputs stay whole
    assert one.activations == 24 * sbh * 34 + head_inputs + 2048 * 50304 * 10
    assert four.activations == 24 * sbh * (10 + 24 // 4) + head_inputs + 2048 * (50304 // 4) * 10


def test_pipeline_plans_the_largest_stage() -> None:
    plan = memory_plan("1.3B", 50304, 2048, 1, 1, 5, 1, 1, "bf16", False, False, grad_accum=8)
    stages = stage_parameters("1.3B", 50304, 2048, pipeline=5)
    assert [sum(p.name.endswith("ln1.weight") for p in s) for s in stages] == [5, 5, 5, 5, 4]
    assert plan.stage == 0 and plan.params_per_rank == sum(p.numel for p in stages[0])  # embeddings + 5 layers
    assert plan.gradients == 2 * plan.params_per_rank  # ZeRO-1 with grad_accum > 1: full gradients


def test_offload_moves_state_to_the_cpu() -> None:
    plan = memory_plan("1.3B", 50304, 2048, 1, 1, 1, 4, 3, "bf16", True, True)
    parts = sum(-(-p.numel // 4) for p in stage_parameters("1.3B", 50304, 2048)[0])
    assert plan.optimizer_state == plan.gradients == plan.step_buffers == 0
    assert plan.cpu == (16 + 2) * parts + 2 * parts
    assert plan.parameters < plan.cpu // 100  # only the small persistent parameters stay on the GPU


@pytest.mark.parametrize(("args", "message"), [
    (("huge", 256, 64, 1, 1, 1, 1, 0, "bf16", False, False), "unknown"),
    (("tiny", 256, 64, 1, 3, 1, 1, 0, "bf16", False, False), "attention heads"),
    (("125M", 50257, 64, 1, 2, 1, 1, 0, "bf16", False, False), "pad the vocabulary"),
    (("tiny", 256, 64, 1, 1, 3, 1, 0, "bf16", False, False), "at most 2"),
    (("tiny", 256, 64, 1, 1, 1, 1, 0, "bf16", True, False), "stage 1-3"),
    (("tiny", 256, 64, 1, 1, 1, 1, 2, "bf16", False, True), "ZeRO-3"),
    (("tiny", 256, 64, 1, 1, 1, 1, 4, "bf16", False, False), "ZeRO stage"),
    (("tiny", 256, 64, 1, 1, 1, 1, 1, "int8", False, False), "precision"),
    (("tiny", 256, 64, 0, 1, 1, 1, 1, "bf16", False, False), "micro_batch"),
])
def test_impossible_layouts_are_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        memory_plan(*args)


def test_rows_and_verdicts() -> None:
    fits = memory_plan("125M", 50304, 1024, 8, 1, 1, 8, 2, "bf16", False, False, 80.0)
    rows = dict(memory_rows(fits))
    assert list(rows)[:7] == ["layout", "parameters", "gradients", "optimizer state", "activations",
                              "DeepSpeed buffers", "total"]
    assert fits.fits is True and rows["verdict"].startswith("fits in 80 GiB with ")
    assert rows["verdict"] == f"fits in 80 GiB with {1 - fits.total / (80 * 2**30):.0%} to spare"
    assert "fp32 master + Adam m, v, 1/8 per rank" in rows["optimizer state"]

    big = memory_plan("7B", 32000, 4096, 4, 1, 1, 8, 2, "bf16", False, False, 80.0)
    verdict = dict(memory_rows(big))["verdict"]
    assert big.fits is False and verdict.startswith(f"does not fit: {big.total / 2**30:.1f} GiB > 80 GiB; try ")
    assert "zero.stage = 3" in verdict and "parallel.tensor = 2" in verdict and "offload_optimizer" in verdict

    unknown = dict(memory_rows(memory_plan("tiny", 256, 64, 2, 1, 1, 1, 0, "fp32", False, False)))
    assert "no GPU memory size" in unknown["verdict"]
    offload = dict(memory_rows(memory_plan("1.3B", 50304, 2048, 1, 1, 1, 4, 3, "bf16", True, True, 40.0)))
    assert "CPU memory" in offload and "in CPU memory" in offload["optimizer state"]


# ------------------------------------------------------------------------------------------------------------------
# What DeepSpeed really holds
# ------------------------------------------------------------------------------------------------------------------

def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _flat(value: Any) -> list[Any]:
    """Tensors in a tensor, a list of them, or a dict of either."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [t for item in value.values() for t in _flat(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _flat(item)]
    return [value]


def _measure(case: tuple[int, str, int], groups: Any, world: int) -> dict[str, int]:
    """One engine, one optimizer step; the bytes it holds per category."""
    import torch

    from hpc_train.config.job import JobConfig
    from hpc_train.config.loader import build
    from hpc_train.distributed.mesh import ModelParallelUnit
    from hpc_train.train.engine import build_engine
    from hpc_train.train.model import GPT, GPTConfig

    stage, precision, accum = case
    config = build(JobConfig, {
        "zero": {"stage": stage}, "data": {"vocab_size": VOCAB},
        "train": {"precision": precision, "seq_len": SEQ, "micro_batch": MICRO, "grad_accum": accum}})
    model = GPT(GPTConfig.from_preset("tiny", VOCAB, SEQ), groups.group("tp"), seed=1)
    engine = build_engine(model, config, world, ModelParallelUnit(groups), None)
    optimizer, basic = engine.optimizer, engine.basic_optimizer
    params = list(engine.module.parameters())
    seen = {"reduce": 0, "step": 0, "grads": 0}

    def watch_buckets(_: Any) -> None:  # ZeRO-1/2 allocate their buckets during the backward pass
        buckets = getattr(optimizer, "ipg_buckets", {})
        seen["reduce"] = max(seen["reduce"], _storage_bytes(t for b in buckets.values() for t in _flat(b.buffer)))

    for param in params:
        param.register_post_accumulate_grad_hook(watch_buckets)
    allreduce_bucket = engine.allreduce_bucket

    def record_allreduce(bucket: Any, *args: Any, **kwargs: Any) -> Any:  # ZeRO-0 flattens the gradients
        seen["reduce"] = max(seen["reduce"], sum(t.numel() * t.element_size() for t in bucket))
        return allreduce_bucket(bucket, *args, **kwargs)

    engine.allreduce_bucket = record_allreduce
    basic_step = basic.step

    def record_step(*args: Any, **kwargs: Any) -> Any:  # the fp32 gradients AdamW is handed, beyond param.grad
        module_grads = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
        copies = [p.grad for g in basic.param_groups for p in g["params"]
                  if p.grad is not None and p.grad.untyped_storage().data_ptr() not in module_grads]
        seen["step"] = max(seen["step"], _storage_bytes(copies))
        return basic_step(*args, **kwargs)

    basic.step = record_step
    torch.manual_seed(7 + groups.rank)
    for _ in range(accum):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ))
        engine.backward(engine(tokens, torch.roll(tokens, -1, 1)))
        held = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
        for name in ("averaged_gradients", "all_grad_tensors", "grad_partitions_flat_buffer"):
            held += _flat(getattr(optimizer, name, None))
        seen["grads"] = max(seen["grads"], _storage_bytes(held))
        engine.step()
    if stage == 3:
        parameters = _storage_bytes([p.ds_tensor for p in params] + [p.data for p in params])
        seen["reduce"] = _storage_bytes(t for b in optimizer.ipg_buckets.values() for t in _flat(b.buffer))
    else:
        parameters = _storage_bytes(params)
    module = {p.untyped_storage().data_ptr() for p in params if p.numel()}
    masters = [t for name in ("fp32_groups", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
               for t in _flat(getattr(optimizer, name, None)) if t.untyped_storage().data_ptr() not in module]
    state = [v for s in basic.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": parameters, "gradients": seen["grads"], "optimizer_state": _storage_bytes(masters + state),
            "reduce_buffers": seen["reduce"], "step_buffers": seen["step"]}


def _deepspeed_worker(rank: int, world: int, cases: list[tuple[int, str, int]]) -> dict[str, Any]:
    # LOCAL_SIZE as DeepSpeed's launcher sets it; build_engine hides it from DeepSpeed's shm all-reduce.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    from hpc_train.distributed.mesh import ParallelGroups
    from hpc_train.distributed.topology import Topology
    from hpc_train.train.model import GPT, GPTConfig

    groups = ParallelGroups(Topology.build(world))
    measured = [_measure(case, groups, world) for case in cases]
    # The same processes check the tensor-parallel shapes: the whole world as one tensor group.
    sharded = GPT(GPTConfig.from_preset("tiny", VOCAB, SEQ), dist.group.WORLD, seed=1)
    shapes = [[name, p.numel(), p.dim() >= 2] for name, p in sharded.named_parameters()]
    return {"measured": measured, "shapes": shapes}


@functools.cache
def _run(world: int) -> list[dict[str, Any]]:
    return run_workers(functools.partial(_deepspeed_worker, cases=CASES), world, timeout_s=300)


def _plan(world: int, case: tuple[int, str, int]) -> MemoryPlan:
    stage, precision, accum = case
    return memory_plan("tiny", VOCAB, SEQ, MICRO, 1, 1, world, stage, precision, False, False, grad_accum=accum)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_plan_matches_what_deepspeed_holds(world: int) -> None:
    results = _run(world)
    lines, failures = [], []
    for index, case in enumerate(CASES):
        plan = _plan(world, case)
        for figure in FIGURES:
            planned = getattr(plan, figure)
            per_rank = [result["measured"][index][figure] for result in results]
            worst = max(per_rank)
            ratio = worst / planned if planned else float(worst == 0)
            lines.append(f"dp={world} ZeRO-{case[0]} {case[1]} accum={case[2]} {figure:16s} planned {planned:>11,} "
                         f"measured {per_rank} ratio {ratio:.3f}")
            if abs(worst - planned) > TOLERANCE * planned:
                failures.append(lines[-1])
    print("\n".join(lines))
    assert not failures, "measured bytes differ from the plan by more than 10 %:\n" + "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_shapes_match_the_model(world: int) -> None:
    for result in _run(world):
        assert [Param(*shape) for shape in result["shapes"]] == stage_parameters("tiny", VOCAB, SEQ, tensor=world)[0]
