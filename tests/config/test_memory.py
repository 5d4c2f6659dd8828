"""The memory plan: its arithmetic by hand, its import (pure Python, for login nodes), what DeepSpeed 0.19
really holds on 2 and 4 data-parallel ranks with ZeRO 0-3 in fp32 and bf16, and what FSDP2 really holds on 2.

The real check builds the engine the trainer builds (``build_engine`` on the tiny GPT), runs one step and adds up
the bytes of the distinct storages behind what DeepSpeed keeps: parameters (module parameters; ZeRO-3: the
partitions ``ds_tensor`` and the parameters it keeps whole), gradients (after each backward pass: ``param.grad``,
the ZeRO-1/2 partition buffers ``averaged_gradients`` / ``all_grad_tensors``, ZeRO-3's flat gradient partition
buffer), optimizer state (AdamW's state tensors and the fp32 master copies), the gradient-reduction buffers (ZeRO-0's
all-reduce copy, the ZeRO-1/2 buckets seen from a gradient hook, ZeRO-3's bucket) and the fp32 gradient copy at
the optimizer step. The plan describes the worst rank, so the largest measured rank must be within TOLERANCE of
the plan and no rank above it by more. The plan models DeepSpeed's layout exactly, so the measured figures match
to within a few bytes (AdamW's step counters); the 10 % is headroom for DeepSpeed releases that move padding.

The FSDP2 check builds the trainer's FSDP2 engine (``Fsdp2Engine``, the GPT built on the meta device) on 2 gloo
ranks on the CPU, with a vocabulary and sequence length of odd sizes so that dim 0 of the embeddings and the head
is padded, runs a step and adds up the same way: the fp32 shards (``to_local``), the gradient shards after the
backward pass, AdamW's m and v (not its step counters), and, sampled at every leaf module's forward and before
its backward, the largest sum of the all-gathered parameters FSDP2 holds (its ``all_gather_outputs``). Each
figure of the worst rank equals the plan's to the byte (rank 1 holds a little less optimizer state: its last
chunk's padding is not stepped); the buffers beside the gathered parameters follow the source and are not
measured (the CPU has no allocator statistics). About 7 s on 2 CPU cores.

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

from hpc_train.config.memory import MemoryPlan, Param, fsdp2_memory_plan, memory_plan, stage_parameters
from hpc_train.config.memory_rows import memory_rows
from tests.conftest import REPO
from tests.rank.distributed.multiproc import run_workers

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
    code = ("import sys, hpc_train.config.memory as m; m.memory_plan('7B', 32000, 4096, 1, 1, 1, 8, 3, 'bf16', "
            "False, False, 80.0); m.fsdp2_memory_plan('7B', 32000, 4096, 1, 1, 8, 'bf16', 80.0); "
            "print(sorted({'torch', 'deepspeed', 'numpy'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                            cwd=REPO)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_parameter_count_matches_the_model_for_every_preset() -> None:
    from hpc_train.config.job import MODEL_PRESETS
    from hpc_train.rank.train.model import GPTConfig, count_parameters

    for preset in MODEL_PRESETS:
        planned = sum(p.numel for stage in stage_parameters(preset, 50304, 1024) for p in stage)
        assert planned == count_parameters(GPTConfig.from_preset(preset, 50304, 1024)), preset
        # pipeline stages cut the same parameters, in order
        stages = stage_parameters(preset, 50304, 1024, pipeline=2)
        assert [p for stage in stages for p in stage] == stage_parameters(preset, 50304, 1024)[0]


def test_parameter_shapes_match_the_built_model() -> None:
    from hpc_train.rank.train.model import GPT, GPTConfig

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
# FSDP2, pure Python
# ------------------------------------------------------------------------------------------------------------------

def test_fsdp2_tiny_bf16_by_hand() -> None:
    # tiny, V=256, S=64, data 2: no padding. Root (wte 32768, wpe 8192, ln_f 256, head 32768) = 73,984 elements,
    # shard 36,992; a block 12h^2 + 13h = 198,272, shard 99,136; everything 470,528, shard 235,264.
    plan = fsdp2_memory_plan("tiny", 256, 64, 2, 1, 2, "bf16")
    assert (plan.engine, plan.zero_stage, plan.params_per_rank) == ("fsdp2", 3, 470_528)
    assert plan.parameters == plan.gradients == 4 * 235_264  # fp32 shards and fp32 gradient shards
    assert plan.optimizer_state == 8 * 235_264  # Adam m, v on the shards; no master copy
    root, block = 2 * 2 * 36_992, 2 * 2 * 99_136  # gathered in bf16: every rank's shard
    assert plan.gathered == root + block == 544_512  # the root stays gathered, one block at a time
    # Peak of the passes: block 1's reduce in the backward pass. The root gathered, the head's and final
    # LayerNorm's bf16 gradients (2 * 33,024), block 0 prefetched, block 1's bf16 gradients (2 * 198,272) and its
    # fp32 reduce-scatter input (4 * 2 * 99,136); block 1's own parameters are freed by then.
    assert plan.reduce_buffers == root + 66_048 + block + 396_544 + 793_088 == 1_800_192
    assert plan.step_buffers == 4 * 466_944 // 2  # AdamW's foreach sqrt(v) of the matrices' shards
    assert plan.buffers == plan.reduce_buffers and plan.cpu == 0
    assert plan.activations == memory_plan("tiny", 256, 64, 2, 1, 1, 2, 3, "bf16", False, False).activations
    assert plan.total == 4 * 235_264 * 4 + plan.activations + 1_800_192
    assert any("root group" in note and "73,984 elements" in note for note in plan.notes)


def test_fsdp2_pads_dim_0_to_a_multiple_of_data() -> None:
    # V=255, S=63 over 2 ranks: wte and head (255 x 128) store 128 rows each rank, wpe (63 x 128) 32 rows: the
    # shards are those of V=256, S=64, which has 3 x 128 parameters more.
    odd, even = fsdp2_memory_plan("tiny", 255, 63, 2, 1, 2, "fp32"), fsdp2_memory_plan("tiny", 256, 64, 2, 1, 2, "fp32")
    assert odd.params_per_rank == even.params_per_rank - 3 * 128
    assert (odd.parameters, odd.gradients, odd.optimizer_state) == (4 * 235_264, 4 * 235_264, 8 * 235_264)
    assert any("pads each tensor's dim 0 to a multiple of 2: 235,264 elements per rank for 470,144" in note
               for note in odd.notes)
    assert not any("pads" in note for note in even.notes)


def test_fsdp2_tensor_parallel_shards_each_rank_s_piece_along_its_rows() -> None:
    # tiny at tensor 2 over 3 data ranks, fp32. Rows per tensor-parallel piece, ceil(rows / 3) stored: wte and head
    # (128 x 128) 43 x 128 = 5,504; wpe (64 x 128) 22 x 128 = 2,816; a block: qkv (192 x 128) 8,192 + 64, the
    # row-parallel projections (128 x 64) 43 x 64 = 2,752 + 43 and (128 x 256) 43 x 256 = 11,008 + 43, fc
    # (256 x 128) 86 x 128 = 11,008 + 86, four LayerNorm vectors 4 x 43 = 172: 33,368; ln_f 86.
    plan = fsdp2_memory_plan("tiny", 256, 64, 2, 2, 3, "fp32")
    shard = 5_504 + 2_816 + 2 * 33_368 + 86 + 5_504
    assert plan.parameters == 4 * shard == 322_584
    assert plan.step_buffers == 4 * 11_008  # with tensor > 1 AdamW steps one tensor at a time


def test_fsdp2_reshard_after_forward_false_keeps_every_block_gathered() -> None:
    # 1.3B over 8 ranks in bf16 (nothing padded): root 2*50304*2048 + 2048*2048 + 2*2048 = 210,243,584 elements,
    # a block 12h^2 + 13h = 50,358,272; head + ln_f 103,026,688.
    g_root, u_root, r_root = 2 * 210_243_584, 2 * 210_243_584, 4 * 210_243_584
    g_block, u_block, r_block = 2 * 50_358_272, 2 * 50_358_272, 4 * 50_358_272
    head = 2 * 103_026_688
    kept = fsdp2_memory_plan("1.3B", 50304, 2048, 1, 1, 8, "bf16", reshard_after_forward=False)
    freed = fsdp2_memory_plan("1.3B", 50304, 2048, 1, 1, 8, "bf16")
    assert freed.gathered == g_root + g_block and kept.gathered == g_root + 24 * g_block
    # kept: the backward pass of block 22 holds blocks 0-22 gathered, its gradients and block 23's input
    assert kept.reduce_buffers == g_root + head + 23 * g_block + u_block + r_block
    # freed: the root's own reduce at the end is the peak, its bf16 gradients beside its fp32 input
    assert freed.reduce_buffers == u_root + r_root
    assert kept.parameters == freed.parameters and kept.optimizer_state == freed.optimizer_state
    assert any("keeps all 24 blocks gathered" in note for note in kept.notes)


def test_fsdp2_offload_keeps_shards_gradients_and_state_in_cpu_memory() -> None:
    offload = fsdp2_memory_plan("tiny", 256, 64, 2, 1, 2, "bf16", offload=True)
    gpu = fsdp2_memory_plan("tiny", 256, 64, 2, 1, 2, "bf16")
    assert offload.parameters == offload.gradients == offload.optimizer_state == offload.step_buffers == 0
    assert offload.cpu == 16 * 235_264
    assert (offload.gathered, offload.reduce_buffers) == (gpu.gathered, gpu.reduce_buffers)
    assert offload.offload_params and offload.offload_optimizer


def test_fsdp2_user_model_is_one_group_gathered_whole() -> None:
    plan = fsdp2_memory_plan("lm.py:build", 256, 64, 2, 1, 4, "bf16", parameters=1_000_000)
    assert plan.parameters == 4 * 250_000 and plan.gathered == 2 * 1_000_000 and plan.activations == 0
    assert any("planned as one group" in note for note in plan.notes)


@pytest.mark.parametrize(("args", "message"), [
    (("tiny", 256, 64, 1, 1, 2, "fp16"), "loss scaler"),
    (("tiny", 256, 64, 1, 1, 0, "bf16"), "data"),
    (("tiny", 256, 64, 1, 3, 1, "bf16"), "attention heads"),
    (("lm.py:build", 256, 64, 1, 1, 2, "bf16"), "parameters = N"),
])
def test_fsdp2_impossible_layouts_are_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fsdp2_memory_plan(*args)


def test_fsdp2_rows_say_fsdp2_and_advise_its_keys() -> None:
    rows = dict(memory_rows(fsdp2_memory_plan("tiny", 256, 64, 2, 1, 2, "bf16", 80.0)))
    assert list(rows)[:7] == ["layout", "parameters", "gradients", "optimizer state", "activations",
                              "FSDP2 buffers", "total"]
    assert "FSDP2, bf16" in rows["layout"] and "ZeRO" not in rows["layout"]
    assert "no master copy" in rows["optimizer state"] and "the bf16 parameters of the root" in rows["FSDP2 buffers"]
    big = dict(memory_rows(fsdp2_memory_plan("7B", 32000, 4096, 4, 1, 8, "fp32", 40.0, reshard_after_forward=False)))
    verdict = big["verdict"]
    assert verdict.startswith("does not fit") and "zero." not in verdict, verdict
    assert "fsdp.reshard_after_forward = true" in verdict and "fsdp.offload = true" in verdict
    offload = dict(memory_rows(fsdp2_memory_plan("7B", 32000, 4096, 1, 1, 8, "bf16", 80.0, offload=True)))
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
    from hpc_train.rank.distributed.mesh import ModelParallelUnit
    from hpc_train.rank.train.engine import build_engine
    from hpc_train.rank.train.model import GPT, GPTConfig

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

    from hpc_train.common.topology import Topology
    from hpc_train.rank.distributed.mesh import ParallelGroups
    from hpc_train.rank.train.model import GPT, GPTConfig

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


# ------------------------------------------------------------------------------------------------------------------
# What FSDP2 really holds
# ------------------------------------------------------------------------------------------------------------------

FSDP2_VOCAB, FSDP2_SEQ = 255, 63  # odd: dim 0 of wte, wpe and head is padded over 2 ranks
# (precision, reshard_after_forward, offload, grad_accum): bf16 gathers in bf16; without resharding every block
# stays gathered; offload (CPUOffloadPolicy) keeps all the rest in CPU memory; accumulating adds no gradients.
FSDP2_CASES = [("bf16", True, False, 1), ("fp32", False, False, 2), ("fp32", True, True, 1)]
FSDP2_FIGURES = ("parameters", "gradients", "optimizer_state", "gathered")


def _fsdp2_params(model: Any) -> list[Any]:
    """The ``FSDPParam`` of every parameter (their ``all_gather_outputs`` are the gathered copies)."""
    from torch.distributed.fsdp import FSDPModule

    return [fsdp_param for module in model.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups for fsdp_param in group.fsdp_params]


def _watch_gathered(model: Any, seen: dict[str, int]) -> None:
    """Keep in ``seen["gathered"]`` the most bytes of gathered parameters held at a leaf module's forward (before
    and after) and just before its backward."""
    import torch

    fsdp_params = _fsdp2_params(model)

    def sample(*_: Any) -> None:
        live = sum(t.untyped_storage().nbytes() for p in fsdp_params for t in p.all_gather_outputs)
        seen["gathered"] = max(seen["gathered"], live)

    def after(module: Any, inputs: Any, output: Any) -> None:
        sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(sample)

    for module in model.modules():
        if not list(module.children()):
            module.register_forward_pre_hook(sample)
            module.register_forward_hook(after)


def _measure_fsdp2(case: tuple[str, bool, bool, int], groups: Any) -> dict[str, int]:
    """The trainer's FSDP2 engine on the meta-built GPT, one optimizer step; the bytes it holds per category."""
    from types import SimpleNamespace

    import torch

    from hpc_train.config.job import JobConfig
    from hpc_train.config.loader import build
    from hpc_train.rank.train.engine_fsdp2 import Fsdp2Engine
    from hpc_train.rank.train.model import GPT, GPTConfig

    precision, reshard, offload, accum = case
    config = build(JobConfig, {
        "data": {"vocab_size": FSDP2_VOCAB}, "fsdp": {"reshard_after_forward": reshard, "offload": offload},
        "train": {"engine": "fsdp2", "precision": precision, "seq_len": FSDP2_SEQ, "micro_batch": MICRO,
                  "grad_accum": accum}})
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("tiny", FSDP2_VOCAB, FSDP2_SEQ), groups.group("tp"), seed=1)
    engine = Fsdp2Engine(model, SimpleNamespace(config=config), groups, torch.device("cpu"))
    seen = {"gathered": 0, "gradients": 0}
    _watch_gathered(model, seen)
    params = list(model.parameters())
    torch.manual_seed(7 + groups.rank)
    for _ in range(accum):
        tokens = torch.randint(0, FSDP2_VOCAB, (MICRO, FSDP2_SEQ))
        engine.backward(engine(tokens, torch.roll(tokens, -1, 1)))
        grads = [p.grad.to_local() for p in params if p.grad is not None]
        seen["gradients"] = max(seen["gradients"], _storage_bytes(grads))
        engine.step()  # clips, steps AdamW and sets the gradients to None on the last micro-batch
    moments = [value.to_local() for state in engine.optimizer.state.values()
               for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")]
    return {"parameters": _storage_bytes(p.to_local() for p in params), "gradients": seen["gradients"],
            "optimizer_state": _storage_bytes(moments), "gathered": seen["gathered"]}


def _fsdp2_worker(rank: int, world: int) -> list[dict[str, int]]:
    from hpc_train.common.topology import Topology
    from hpc_train.rank.distributed.mesh import ParallelGroups

    groups = ParallelGroups(Topology.build(world))
    return [_measure_fsdp2(case, groups) for case in FSDP2_CASES]


@pytest.mark.slow
def test_plan_matches_what_fsdp2_holds() -> None:
    results = run_workers(_fsdp2_worker, 2, timeout_s=120)
    lines, failures = [], []
    for index, (precision, reshard, offload, accum) in enumerate(FSDP2_CASES):
        plan = fsdp2_memory_plan("tiny", FSDP2_VOCAB, FSDP2_SEQ, MICRO, 1, 2, precision, offload=offload,
                                 reshard_after_forward=reshard, grad_accum=accum)
        per_rank = [result[index] for result in results]
        # offload: the plan's GPU figures are 0 and its CPU memory is their sum (4 + 4 + 8 bytes a shard element);
        # on a CPU run both are in the same memory
        planned = {figure: getattr(plan, figure) for figure in FSDP2_FIGURES}
        if offload:
            assert planned["parameters"] == planned["gradients"] == planned["optimizer_state"] == 0
            planned = {**planned, "parameters": plan.cpu // 4, "gradients": plan.cpu // 4,
                       "optimizer_state": plan.cpu // 2}
        for figure in FSDP2_FIGURES:
            measured = [rank[figure] for rank in per_rank]
            lines.append(f"FSDP2 dp=2 {precision} reshard={reshard} offload={offload} accum={accum} {figure:16s} "
                         f"planned {planned[figure]:>9,} measured {measured}")
            if max(measured) != planned[figure]:
                failures.append(lines[-1])
    print("\n".join(lines))
    assert not failures, "measured bytes differ from the plan:\n" + "\n".join(failures)
