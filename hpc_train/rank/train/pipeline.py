"""Pipeline parallelism for the GPT of :mod:`hpc_train.rank.train.model` through DeepSpeed's pipeline engine.

Why: a model too deep for the memory of one tensor-parallel group is cut into consecutive stages, one per rank
along the pipeline axis, and micro-batches flow through the stages (DeepSpeed's 1F1B schedule), so every stage
holds only its own layers, their gradients and their optimizer state.

What this module guarantees:

* The same computation as ``GPT.forward``: the layer list is the embedding (token + position), the blocks, then
  the final LayerNorm with the head, and the loss is the mean vocabulary-parallel cross entropy, computed on the
  last stage. Each layer is built from model.py's own classes and seeds, so every weight is bit-identical to the
  matching weight of ``GPT(config, tp_group, seed)``; a stage builds only its layers (DeepSpeed does build every
  layer once, one at a time, to count parameters for ``partition_method="parameters"``).
* The rank layout is ours: DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; model
  innermost) is checked rank by rank against our :class:`~hpc_train.common.topology.Topology`, and a layout it
  cannot express (context parallelism, or an order other than tensor-data-pipeline from the inside out) is
  refused with a ValueError instead of training on groups that silently differ from ours.
* Gradient norms count every gradient once. DeepSpeed hands its pipeline grid to ``clip_grad_norm_`` as the
  ``mpu``, and the grid's "model-parallel rank" is the rank inside the whole pipe x tensor group, so without help
  only the first stage would count its LayerNorms and other tensor-replicated parameters. We mark those
  parameters as model-parallel on tensor rank 0 of every stage (where every DeepSpeed norm already counts them),
  which makes the ZeRO-0 clipping norm right and leaves ZeRO-1 and bf16 norms as they were.

Batches are DeepSpeed's ``(inputs, labels)`` pairs, here ``(tokens, targets)`` int64 tensors of one fixed shape
``[micro_batch, seq_len]`` (the engine sends activation shapes once, with the first batch). ``deepspeed.initialize``
must get this module with ``mpu`` left out: the module's own grid is the mpu.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from hpc_train.common.topology import Topology
from hpc_train.config.model_shapes import gpt_parameter_name
from hpc_train.rank.distributed.tensor_parallel import (
    ColumnParallelLinear,
    tp_rank,
    vocab_parallel_cross_entropy,
)
from hpc_train.rank.train.dscomm import init_deepspeed_comm
from hpc_train.rank.train.model import Block, GPTConfig, _mark_sharded, make_embeddings

__all__ = [
    "EmbeddingStage",
    "HeadStage",
    "VocabParallelLoss",
    "build_pipeline_model",
    "deepspeed_topology",
    "eval_step",
    "gpt_parameter_name",
    "mark_replicated",
    "train_step",
]

Batch = tuple[torch.Tensor, torch.Tensor]


class EmbeddingStage(nn.Module):
    """``wte(tokens) + wpe(positions)``: GPT's first layer, with GPT's weights for the same seed."""

    def __init__(self, config: GPTConfig, group: Any, seed: int) -> None:
        super().__init__()
        self.wte, self.wpe = make_embeddings(config, group, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(positions)


class HeadStage(nn.Module):
    """``head(ln_f(x))``: this rank's vocabulary shard of the logits, with GPT's weights for the same seed."""

    def __init__(self, config: GPTConfig, group: Any, seed: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = ColumnParallelLinear(config.hidden, config.vocab_size, group, bias=False, seed=seed + 2)
        _mark_sharded(self.head, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class VocabParallelLoss:
    """The pipeline's ``loss_fn``: mean cross entropy of vocabulary-parallel logits, as in ``GPT.forward``."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits.float(), targets, self.group).mean()


def deepspeed_topology(topology: Topology) -> PipeModelDataParallelTopology:
    """DeepSpeed's topology for ``topology``, checked to put every rank at our coordinates (ValueError if not)."""
    sizes = topology.sizes
    if sizes["cp"] > 1:
        raise ValueError(f"context parallelism (context = {sizes['cp']}) is not supported with DeepSpeed's pipeline "
                         "engine; set parallel.context = 1 when parallel.pipeline > 1")
    ds_topology = PipeModelDataParallelTopology(num_pp=sizes["pp"], num_mp=sizes["tp"], num_dp=sizes["dp"])
    for coord, rank in ds_topology.mapping.items():
        ours = topology.coords(rank)
        if (coord.pipe, coord.data, coord.model) != (ours["pp"], ours["dp"], ours["tp"]):
            raise ValueError(
                f"order {'-'.join(topology.order)!r} puts rank {rank} at pipeline {ours['pp']}, data {ours['dp']}, "
                f"tensor {ours['tp']}, but DeepSpeed's pipeline engine lays ranks out tensor innermost, then data, "
                f"then pipeline (pipeline {coord.pipe}, data {coord.data}, tensor {coord.model}); use order "
                "'tp-cp-dp-pp' with parallel.pipeline > 1")
    return ds_topology


def _check_tp_group(topology: Topology, tp_group: Any) -> None:
    rank = dist.get_rank()
    expected = topology.group_of(rank, "tp")
    actual = (dist.get_process_group_ranks(tp_group) if tp_group is not None
              else list(range(dist.get_world_size())))
    if sorted(actual) != expected:
        raise ValueError(f"rank {rank}: the tensor group holds ranks {sorted(actual)}, but the topology's tensor "
                         f"group of this rank is {expected}; pass ParallelGroups(topology).group('tp')")


def mark_replicated(module: nn.Module, group: Any) -> None:
    """Count tensor-replicated parameters once per stage in DeepSpeed's norms (see the module docstring)."""
    first = tp_rank(group) == 0
    for param in module.parameters():
        if not getattr(param, "model_parallel", False):
            param.model_parallel = first


def build_pipeline_model(config: GPTConfig, topology: Topology, tp_group: Any, seed: int,
                         local_rank: int | None = None) -> PipelineModule:
    """``GPT(config, tp_group, seed)`` as a DeepSpeed PipelineModule of ``topology.sizes["pp"]`` stages.

    Layers: 0 the embedding, 1..layers the blocks, layers + 1 the final LayerNorm and head; cut into stages with
    balanced parameter counts. Needs torch.distributed initialised with ``topology.world`` ranks (DeepSpeed's
    communication layer adopts it) and the ``LOCAL_RANK`` environment variable (read by DeepSpeed). ValueError
    for a layout DeepSpeed cannot express.
    """
    ds_topology = deepspeed_topology(topology)
    if not dist.is_initialized() or dist.get_world_size() != topology.world:
        found = f"{dist.get_world_size()} ranks" if dist.is_initialized() else "no process group"
        raise ValueError(f"the pipeline needs torch.distributed with {topology.world} ranks (the topology's world), "
                         f"found {found}")
    _check_tp_group(topology, tp_group)
    init_deepspeed_comm(local_rank)  # PipelineModule talks through deepspeed.comm: adopt our group
    layers = [LayerSpec(EmbeddingStage, config, tp_group, seed)]
    layers += [LayerSpec(Block, config, tp_group, seed + 100 * (i + 1)) for i in range(config.layers)]
    layers.append(LayerSpec(HeadStage, config, tp_group, seed))
    model = PipelineModule(layers=layers, topology=ds_topology, loss_fn=VocabParallelLoss(tp_group),
                           partition_method="parameters")
    mark_replicated(model, tp_group)
    return model


def _take(engine: deepspeed.PipelineEngine, batches: Iterator[Batch], count: int) -> list[Batch]:
    """Exactly ``count`` batches, pulled on every rank so every rank's sampler stays at the same position."""
    taken = []
    for _ in range(count):
        try:
            taken.append(next(batches))
        except StopIteration:
            raise ValueError(f"the batch iterator ran out after {len(taken)} of the {count} micro-batches this "
                             f"step needs (rank {engine.global_rank})") from None
    return taken


def train_step(engine: deepspeed.PipelineEngine, batches: Iterator[Batch]) -> float:
    """One optimizer step over ``engine.gradient_accumulation_steps()`` micro-batches of ``(tokens, targets)``.

    Returns the step's mean loss over the global batch, the same number on every rank (DeepSpeed averages it
    over the data-parallel group on the last stage and broadcasts it along each pipeline).
    """
    taken = _take(engine, batches, engine.gradient_accumulation_steps())
    return float(engine.train_batch(data_iter=iter(taken)))


def eval_step(engine: deepspeed.PipelineEngine, batches: Iterator[Batch], micro_batches: int | None = None) -> float:
    """Mean loss over ``micro_batches`` (default: the gradient accumulation steps) micro-batches per data-parallel
    rank, without gradients; the same number on every rank."""
    count = engine.gradient_accumulation_steps() if micro_batches is None else micro_batches
    taken = _take(engine, batches, count)
    loss = engine.eval_batch(data_iter=iter(taken), num_micro_batches=count)
    return float(loss)
