"""The memory plan of a job: bytes per rank of parameters, gradients, optimizer state, activations and the
engine's own buffers (DeepSpeed's, or FSDP2's), and whether that fits the site's GPUs, computed before anything is
submitted.

Why: an out-of-memory error costs a queue wait and a start-up before it shows; the arithmetic below costs
nothing. ``python -m hpc_train validate CONFIG --memory`` prints the rows
(:mod:`hpc_train.config.memory_rows`) of :func:`memory_plan` (of :func:`fsdp2_memory_plan` for FSDP2). This
module is pure Python (no torch, deepspeed or numpy) because it runs on login nodes.

Accounting. The base is the ZeRO paper (Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054): mixed
precision Adam holds 2 bytes of 16-bit weights, 2 of 16-bit gradients and 12 of optimizer state (fp32 master
weights, Adam m and v) per parameter; ZeRO-1 shards the optimizer state over the data-parallel ranks, ZeRO-2
also the gradients, ZeRO-3 also the parameters. What DeepSpeed 0.19 actually holds with a torch AdamW (read in
``deepspeed/runtime/zero/stage_1_and_2.py``, ``stage3.py``, ``fp16/unfused_optimizer.py`` and ``engine.py``, and
measured by ``tests/config/test_memory.py``) differs in these places, all modelled here:

* fp32 training under ZeRO 1-3 still keeps a separate fp32 master partition (4 bytes / parameter / data rank)
  beside the fp32 model weights; only ZeRO-0 fp32 steps the module's own parameters.
* ZeRO-0 in bf16/fp16 wraps AdamW in ``FP16_UnfusedOptimizer``: a full fp32 master copy, and at the step an fp32
  copy of every gradient (4 bytes / parameter) beside the 16-bit ones.
* ZeRO-1 and ZeRO-2 keep the gradients of the parameters that touch the rank's partition, WHOLE: a parameter that
  straddles a partition boundary is held in full by both ranks (``grads_in_partition``). The plan lays the
  parameters out as DeepSpeed does (two parameter groups, matrices with weight decay first, flattened in module
  order, padded to 2 x data elements, cut into equal partitions) and reports the largest rank.
* ZeRO-1 with ``grad_accum = 1`` reduces gradients bucket by bucket during the backward pass and keeps only its
  partition, like ZeRO-2; with ``grad_accum > 1`` it holds the full 16-bit gradients between micro-batches (the
  paper's figure).
* ZeRO-1/2 allocate ``reduce_bucket_size`` elements of gradient buckets (twice, with ``overlap_comm``) at the start
  of each backward pass, whatever the model's size (2 x 50M x 2 bytes = 200 MB for the tiny model). ZeRO-3 holds
  one bucket for the whole run.
* ZeRO-3 keeps every parameter of at most 100,000 elements (``stage3_param_persistence_threshold``) gathered in
  full on every rank, on top of its partition; its gradient partitions are one flat buffer allocated at start-up.
  Each parameter is padded to a multiple of the data-parallel size.
* The optimizer step makes an fp32 copy of the gradient partition of one parameter group (ZeRO-3: one sub-group
  of at most 1e9 elements); ZeRO-0 flattens all gradients into one all-reduce buffer (chunks of 5e8 elements).

``buffers`` is the peak of these working buffers: the backward-time ones (buckets, the ZeRO-0 all-reduce copy,
the parameters ZeRO-3 gathers for one module plus its 5e7-element prefetch) and the step-time fp32 copy do not
coexist, except ZeRO-3's permanent bucket. DeepSpeed also makes a 16-bit flat copy of the partition's gradients
for an instant before casting it to fp32; it is not counted (activations, which ``total`` includes, are freed by
then). Offload figures (CPU Adam, parameters in CPU memory) follow the source and are not measured by the tests.

FSDP2 (``train.engine = "fsdp2"``, :func:`fsdp2_memory_plan`) has its own accounting, explained and sourced in
:mod:`hpc_train.config.memory_fsdp2`: fp32 shards of each tensor's dim 0 (padded), fp32 gradient shards, AdamW's m
and v on them, no master copy; its buffers are the gathered groups (the root for the whole step), their flat
all-gather buffers, the unsharded gradients and the fp32 reduce-scatter inputs.

Activations are a rough estimate from Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198), equation 2:
per layer ``s*b*h*(10 + 24/t)`` bytes in 16-bit for ``s`` tokens, micro batch ``b``, width ``h`` and tensor
parallel size ``t``, without the ``5*a*s/(h*t)`` attention-score term because ``scaled_dot_product_attention``'s
fused kernels keep no ``s x s`` matrices; doubled in fp32. Plus the vocabulary-parallel loss: the logits, their
fp32 copy and the saved fp32 softmax (``s*b*V/t`` x 10 bytes, 8 in fp32). With pipeline parallelism (1F1B) the
first stage holds ``min(pipeline, grad_accum)`` micro-batches in flight. No activation checkpointing.

Tensor parallelism: the query/key/value, the MLP's first layer (weights and biases), the projections' weights,
the token embedding and the head are split ``tensor`` ways; LayerNorms, the projections' biases and the position
embedding are replicated (see :mod:`hpc_train.rank.train.model`). Pipeline parallelism cuts the layers into contiguous
stages (the first stages take the remainder), the embeddings on the first, the final LayerNorm and head on the
last; the plan is the stage with the largest total. GiB are 2**30 bytes, and ``gpu_mem_gb`` is read the same way
(an "80 GB" GPU has 80 GiB). The CUDA context and allocator fragmentation are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from hpc_train.config.job import MODEL_PRESETS
from hpc_train.config.memory_fsdp2 import fsdp2_held
from hpc_train.config.model_shapes import Param, gpt_stage_parameters, require_positive

__all__ = ["GIB", "PRECISION_BYTES", "MemoryPlan", "Param", "assumed_precision", "fsdp2_memory_plan", "memory_plan",
           "stage_parameters"]

GIB = 2**30
#: DeepSpeed 0.19 defaults our ``deepspeed_config`` leaves alone.
PERSISTENCE_THRESHOLD = 100_000  # zero_optimization.stage3_param_persistence_threshold
PREFETCH_BUCKET = 50_000_000  # zero_optimization.stage3_prefetch_bucket_size
SUB_GROUP_SIZE = 1_000_000_000  # zero_optimization.sub_group_size
ALLREDUCE_CHUNK = 500_000_000  # engine.MEMORY_OPT_ALLREDUCE_SIZE, the ZeRO-0 all-reduce buffer
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def assumed_precision(precision: str, gpus_per_node: int) -> tuple[str, str]:
    """What the login node plans with for ``precision``: ``"auto"`` is decided on the nodes (see
    :mod:`hpc_train.rank.train.precision`), so the plan assumes bf16 when the job's nodes have GPUs and fp32
    otherwise, and says so in a note; an explicit precision comes back as it is with no note."""
    if precision != "auto":
        return precision, ""
    assumed = "bf16" if gpus_per_node else "fp32"
    where = "the nodes have GPUs" if gpus_per_node else "the nodes have no GPUs"
    return assumed, (f"precision auto is decided on the nodes; planned as {assumed} ({where}; a CPU with native "
                     "bf16 trains in bf16, a GPU without bf16 in fp32)")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank (the largest rank: the largest pipeline stage, the data-parallel rank holding the most).

    ``parameters``, ``gradients``, ``optimizer_state`` are what DeepSpeed keeps on the GPU (the fp32 master copy
    is optimizer state); ``buffers`` the peak of its working buffers, of which ``reduce_buffers`` (gradient
    buckets, the ZeRO-0 all-reduce copy, ZeRO-3's bucket and gathered parameters) live in the backward pass and
    ``step_buffers`` (the fp32 gradient copy) in the optimizer step; ``activations`` is rough. ``total`` sums
    them; ``cpu`` is what offload puts in CPU memory. ``fits`` is None when the site gives no GPU memory size.
    With ``engine`` "fsdp2" the figures are FSDP2's (:mod:`hpc_train.config.memory_fsdp2`): ``zero_stage`` is 3
    (the layout it shares), both offload flags are ``fsdp.offload``, and ``gathered`` (part of
    ``reduce_buffers``) is the root with its largest block gathered (every block without resharding); the
    backward pass's prefetch of the next block is counted in ``reduce_buffers`` beside it.
    """

    preset: str
    precision: str
    zero_stage: int
    tensor: int
    pipeline: int
    data: int
    micro_batch: int
    seq_len: int
    grad_accum: int
    offload_optimizer: bool
    offload_params: bool
    stage: int
    params_per_rank: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    reduce_buffers: int
    step_buffers: int
    buffers: int
    total: int
    cpu: int
    gpu_bytes: int
    fits: bool | None
    notes: tuple[str, ...]
    engine: str = "deepspeed"
    reshard_after_forward: bool = True
    gathered: int = 0


def stage_parameters(preset: str, vocab_size: int, seq_len: int, tensor: int = 1,
                     pipeline: int = 1) -> list[list[Param]]:
    """The parameters one tensor-parallel rank of each pipeline stage holds: the GPT's presets (what its model
    spec says too); a model of your own is counted from ``[train] parameters``."""
    return gpt_stage_parameters(preset, vocab_size, seq_len, tensor, pipeline)


def _user_stages(parameters: int, tensor: int, pipeline: int) -> list[list[Param]]:
    """A user model known only by its parameter count (``train.parameters``): one matrix, split evenly over the
    tensor and pipeline ranks (the best the login node can do without importing the model)."""
    require_positive(parameters=parameters)
    per_rank = -(-parameters // (tensor * pipeline))
    return [[Param("model.weight", per_rank, True)] for _ in range(pipeline)]


def _groups(params: list[Param]) -> list[list[Param]]:
    """``build_engine``'s optimizer groups, empty ones dropped as DeepSpeed does: matrices, then the rest."""
    return [group for group in ([p for p in params if p.matrix], [p for p in params if not p.matrix]) if group]


def _zero12_layout(group: list[Param], data: int) -> tuple[int, int, list[int]]:
    """One group as DeepSpeed's ZeRO-1/2 lays it out: (flat elements, partition elements, gradient elements
    each data rank holds). The flat buffer is padded to 2 x data; a parameter belongs to every partition it
    touches, and its gradient is kept whole there."""
    numel = sum(p.numel for p in group)
    flat = -(-numel // (2 * data)) * (2 * data)
    part = flat // data
    held = [0] * data
    offset = 0
    for p in group:
        first, last = offset // part, min(data - 1, (offset + p.numel - 1) // part)
        for rank in range(first, last + 1):
            held[rank] += p.numel
        offset += p.numel
    return flat, part, held


def _allreduce_chunk(params: list[Param]) -> int:
    """Largest flat buffer of ZeRO-0's all-reduce: gradients in module order, flushed once past 5e8 elements."""
    largest = chunk = 0
    for p in params:
        chunk += p.numel
        if chunk > ALLREDUCE_CHUNK:
            largest, chunk = max(largest, chunk), 0
    return max(largest, chunk)


def _largest_sub_group(group: list[Param], data: int) -> int:
    """Partition elements of the largest ZeRO-3 optimizer sub-group of a parameter group."""
    parts = [-(-p.numel // data) for p in group]
    if sum(parts) <= SUB_GROUP_SIZE:
        return sum(parts)
    largest = current = 0
    for part in parts:
        current += part
        if current >= SUB_GROUP_SIZE:
            largest, current = max(largest, current), 0
    return max(largest, current)


def _activations(shape: dict[str, int], vocab_size: int, seq_len: int, micro_batch: int, tensor: int,
                 width: int, layers: int, in_flight: int, last: bool) -> int:
    """Korthikanti et al. 2022 eq. 2 without the attention-score term (see the module docstring)."""
    h, t, tokens = shape["hidden"], tensor, seq_len * micro_batch
    per_layer = tokens * h * (10 * t + 24) * width // (2 * t)
    total = layers * per_layer * in_flight
    if last:  # final LayerNorm and head inputs, logits, their fp32 copy and the saved fp32 softmax
        total += 2 * tokens * h * width + tokens * (vocab_size // t) * (10 if width == 2 else 8)
    return total


class _Working(NamedTuple):
    """What the engine holds for one stage (DeepSpeed under one ZeRO stage, or FSDP2), in bytes, and the notes
    that explain it."""

    parameters: int
    gradients: int
    optimizer: int
    reduce_buffers: int
    step_buffers: int
    buffers: int
    cpu: int
    notes: list[str]
    gathered: int = 0


def _zero0(params: list[Param], width: int) -> _Working:
    n = sum(p.numel for p in params)
    reduce_buffers = width * _allreduce_chunk(params)
    step_buffers = 4 * n if width == 2 else 0
    notes = ["ZeRO-0 in 16-bit makes an fp32 copy of every gradient at the optimizer step"] if width == 2 else []
    return _Working(width * n, width * n, 8 * n + (4 * n if width == 2 else 0), reduce_buffers, step_buffers,
                    max(reduce_buffers, step_buffers), 0, notes)


def _zero12(params: list[Param], *, data: int, zero_stage: int, width: int, offload_optimizer: bool,
            grad_accum: int, bucket_size: int, overlap_comm: bool) -> _Working:
    n = sum(p.numel for p in params)
    layouts = [_zero12_layout(group, data) for group in _groups(params)]
    flat = sum(layout[0] for layout in layouts)
    part = sum(layout[1] for layout in layouts)
    held = max(sum(layout[2][rank] for layout in layouts) for rank in range(data))
    notes: list[str] = []
    cpu = 0
    gradients = width * held
    if zero_stage == 1 and grad_accum > 1:
        gradients = max(gradients, width * n)
        notes.append("ZeRO-1 with grad_accum > 1 holds the full gradients between micro-batches")
    optimizer = 12 * part
    reduce_buffers = (2 if overlap_comm else 1) * bucket_size * width
    step_buffers = 4 * max(layout[1] for layout in layouts)
    if data > 1 and held > part * 1.02:
        notes.append(f"gradients of parameters straddling a partition boundary are kept whole: "
                     f"{held:,} elements held for a {part:,}-element partition")
    if offload_optimizer:
        cpu += (16 + width) * part  # master, Adam m and v, fp32 gradients, 16-bit staging copy
        if grad_accum > 1 and zero_stage == 2:
            cpu += width * held  # gradients accumulated in CPU memory between micro-batches
        optimizer = 0
        gradients = width * n if (zero_stage == 1 and grad_accum > 1) else 0
        reduce_buffers += width * max(p.numel for p in params)  # GPU staging of one gradient
        step_buffers = 0
    notes.append(f"gradient buckets: {2 if overlap_comm else 1} x {bucket_size:,} elements during the backward "
                 "pass, whatever the model's size")
    return _Working(width * flat, gradients, optimizer, reduce_buffers, step_buffers,
                    max(reduce_buffers, step_buffers), cpu, notes)


def _zero3(params: list[Param], *, data: int, width: int, offload_optimizer: bool, offload_params: bool,
           bucket_size: int) -> _Working:
    parts = sum(-(-p.numel // data) for p in params)
    persistent = [p for p in params if p.numel <= PERSISTENCE_THRESHOLD]
    kept = sum(p.numel for p in persistent)
    modules: dict[str, int] = {}
    for p in params:
        if p.numel > PERSISTENCE_THRESHOLD:
            module = p.name.rsplit(".", 1)[0]
            modules[module] = modules.get(module, 0) + p.numel
    gathered = width * min(sum(modules.values()), max(modules.values()) + PREFETCH_BUCKET) if modules else 0
    parameters, gradients, optimizer = width * (parts + kept), width * parts, 12 * parts
    bucket = bucket_size * width
    step_buffers = 4 * max(_largest_sub_group(group, data) for group in _groups(params))
    notes: list[str] = []
    if persistent:
        notes.append(f"ZeRO-3 keeps {len(persistent)} parameters of <= {PERSISTENCE_THRESHOLD:,} elements "
                     f"({kept:,} elements) whole on every rank, besides their partitions")
    notes.append(f"ZeRO-3 holds one {bucket_size:,}-element gradient bucket for the whole run")
    cpu = 0
    if offload_optimizer:
        cpu += (16 + width) * parts  # master, Adam m and v, fp32 step gradients, 16-bit gradient partitions
        optimizer, gradients, step_buffers = 0, 0, 0
    if offload_params:
        cpu += width * parts
        parameters = width * kept
    return _Working(parameters, gradients, optimizer, bucket + gathered, step_buffers,
                    bucket + max(gathered, step_buffers), cpu, notes)


def _plan_stage(index: int, params: list[Param], held: _Working, *, shape: dict[str, int] | None,
                vocab_size: int, seq_len: int, micro_batch: int, tensor: int, pipeline: int, width: int,
                grad_accum: int) -> tuple[dict[str, int], list[str]]:
    in_flight = min(pipeline - index, grad_accum) if pipeline > 1 else 1
    layers = sum(1 for p in params if p.name.endswith(".ln1.weight"))
    activations = 0 if shape is None else _activations(shape, vocab_size, seq_len, micro_batch, tensor, width,
                                                       layers, in_flight, last=index == pipeline - 1)
    figures = {"params_per_rank": sum(p.numel for p in params), "parameters": held.parameters,
               "gradients": held.gradients, "optimizer_state": held.optimizer, "activations": activations,
               "reduce_buffers": held.reduce_buffers, "step_buffers": held.step_buffers, "buffers": held.buffers,
               "cpu": held.cpu, "gathered": held.gathered,
               "total": held.parameters + held.gradients + held.optimizer + activations + held.buffers}
    return figures, held.notes


def _plan(preset: str, vocab_size: int, seq_len: int, micro_batch: int, tensor: int, pipeline: int, data: int,
          precision: str, gpu_mem_gb: float, *, grad_accum: int, gpus_per_node: int, parameters: int,
          held: Callable[[list[Param], int], _Working], **engine: Any) -> MemoryPlan:
    """The plan of either engine: ``held(params, width)`` is what it keeps of one stage, ``engine`` its own
    :class:`MemoryPlan` fields; the stage with the largest total is the plan."""
    precision, assumption = assumed_precision(precision, gpus_per_node)
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r} is unknown; use one of {', '.join(PRECISION_BYTES)}")
    require_positive(micro_batch=micro_batch, data=data, grad_accum=grad_accum)
    if gpu_mem_gb < 0 or math.isnan(gpu_mem_gb):
        raise ValueError(f"gpu_mem_gb = {gpu_mem_gb}: must be >= 0 (0: unknown)")
    user = ":" in preset  # an entry point; any other name is a preset (unknown ones are refused below)
    if user and not parameters:
        raise ValueError(f"the login node cannot size your model {preset} without importing it; set "
                         "[train] parameters = N (its parameter count) to plan it")
    stages = _user_stages(parameters, tensor, pipeline) if user else stage_parameters(preset, vocab_size, seq_len,
                                                                                        tensor, pipeline)
    width = PRECISION_BYTES[precision]
    plans = [_plan_stage(i, params, held(params, width), shape=MODEL_PRESETS.get(preset), vocab_size=vocab_size,
                         seq_len=seq_len, micro_batch=micro_batch, tensor=tensor, pipeline=pipeline, width=width,
                         grad_accum=grad_accum)
             for i, params in enumerate(stages)]
    index = max(range(len(plans)), key=lambda i: plans[i][0]["total"])
    figures, notes = plans[index]
    notes = ([assumption] if assumption else []) + notes
    if user:
        notes.append(f"your model is planned from train.parameters = {parameters:,}, split evenly over tensor x "
                     "pipeline; its activations are not counted")
    gpu_bytes = round(gpu_mem_gb * GIB)
    return MemoryPlan(preset=preset, precision=precision, tensor=tensor, pipeline=pipeline, data=data,
                      micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, stage=index,
                      gpu_bytes=gpu_bytes, fits=None if gpu_bytes == 0 else figures["total"] <= gpu_bytes,
                      notes=tuple(notes), **engine, **figures)


def memory_plan(preset: str, vocab_size: int, seq_len: int, micro_batch: int, tensor: int, pipeline: int, data: int,
                zero_stage: int, precision: str, offload_optimizer: bool, offload_params: bool,
                gpu_mem_gb: float = 0.0, *, grad_accum: int = 1, bucket_size: int = 50_000_000,
                overlap_comm: bool = True, gpus_per_node: int = 0, parameters: int = 0) -> MemoryPlan:
    """Bytes per rank of one DeepSpeed layout (see the module docstring for the accounting).

    ``preset`` may be a user model's entry point with its parameter count in ``parameters``: its weights,
    gradients, optimizer state and DeepSpeed's buffers are planned as for any model, its activations are not.

    ``bucket_size`` and ``overlap_comm`` are ``zero.bucket_size`` and ``zero.overlap_comm``; ``gpu_mem_gb`` is the
    site's ``node.gpu_mem_gb`` (0: unknown, ``fits`` is None). Raises ValueError for a layout the model or
    DeepSpeed cannot run. ``precision`` may be ``"auto"``: see :func:`assumed_precision` (``gpus_per_node``).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage = {zero_stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    require_positive(bucket_size=bucket_size)
    if offload_optimizer and zero_stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1-3, stage is 0; set zero.stage = 1 or more")
    if offload_params and zero_stage != 3:
        raise ValueError(f"offload_params needs ZeRO-3, stage is {zero_stage}; set zero.stage = 3")

    def held(params: list[Param], width: int) -> _Working:
        if zero_stage == 0:
            return _zero0(params, width)
        if zero_stage in (1, 2):
            return _zero12(params, data=data, zero_stage=zero_stage, width=width,
                           offload_optimizer=offload_optimizer, grad_accum=grad_accum, bucket_size=bucket_size,
                           overlap_comm=overlap_comm)
        return _zero3(params, data=data, width=width, offload_optimizer=offload_optimizer,
                      offload_params=offload_params, bucket_size=bucket_size)

    return _plan(preset, vocab_size, seq_len, micro_batch, tensor, pipeline, data, precision, gpu_mem_gb,
                 grad_accum=grad_accum, gpus_per_node=gpus_per_node, parameters=parameters, held=held,
                 zero_stage=zero_stage, offload_optimizer=offload_optimizer, offload_params=offload_params)


def fsdp2_memory_plan(preset: str, vocab_size: int, seq_len: int, micro_batch: int, tensor: int, data: int,
                      precision: str, gpu_mem_gb: float = 0.0, *, offload: bool = False,
                      reshard_after_forward: bool = True, grad_accum: int = 1, gpus_per_node: int = 0,
                      parameters: int = 0) -> MemoryPlan:
    """Bytes per rank of one FSDP2 layout (``train.engine = "fsdp2"``; :mod:`hpc_train.config.memory_fsdp2`):
    ``offload`` and ``reshard_after_forward`` are the ``[fsdp]`` keys, the rest as for :func:`memory_plan`.
    Raises ValueError for fp16, which the FSDP2 engine does not train."""
    if precision == "fp16":
        raise ValueError('fp16 needs a loss scaler, which train.engine = "fsdp2" does not have; use bf16 or fp32')
    hidden = MODEL_PRESETS.get(preset, {}).get("hidden", 0)

    def held(params: list[Param], width: int) -> _Working:
        f = fsdp2_held(params, data=data, width=width, hidden=hidden, offload=offload,
                       reshard_after_forward=reshard_after_forward, tensor=tensor)
        return _Working(f.parameters, f.gradients, f.optimizer, f.reduce_buffers, f.step_buffers,
                        max(f.reduce_buffers, f.step_buffers), f.cpu, list(f.notes), f.gathered)

    return _plan(preset, vocab_size, seq_len, micro_batch, tensor, 1, data, precision, gpu_mem_gb,
                 grad_accum=grad_accum, gpus_per_node=gpus_per_node, parameters=parameters, held=held,
                 zero_stage=3, offload_optimizer=offload, offload_params=offload, engine="fsdp2",
                 reshard_after_forward=reshard_after_forward)
