"""Pipeline parallelism for your own model: the factory returns ``pipeline_layers(layers, loss_fn)``.

``layers`` are the model's layers in order (modules, or DeepSpeed ``LayerSpec``s so that a rank builds only its
own stage's), each taking the previous one's output; ``loss_fn(output, labels)`` is the loss on the last. With
``parallel.pipeline > 1`` they become a DeepSpeed ``PipelineModule`` cut into stages of balanced parameter
counts (batches are ``(inputs, labels)`` tuples); with ``parallel.pipeline = 1`` the same factory gives one
module, :class:`SequentialWithLoss`, so a run can move between the two. Either way the parameters are named
``"<layer index>.<name>"``, as ``nn.Sequential(*layers)`` names them, which is what ``ckpt export`` writes.

This module imports torch and DeepSpeed inside the functions only: a factory may import it anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PipelineLayers", "build_pipeline", "pipeline_layers", "sequential_with_loss"]


@dataclass(frozen=True)
class PipelineLayers:
    """What a factory returns for a model that can be cut into pipeline stages."""

    layers: tuple[Any, ...]
    loss_fn: Callable[[Any, Any], Any]


def pipeline_layers(layers: Sequence[Any], loss_fn: Callable[[Any, Any], Any]) -> PipelineLayers:
    """``layers`` in order and the loss of the last one's output against the labels; ValueError if empty."""
    if not layers:
        raise ValueError("pipeline_layers: no layers; give the model's layers in order")
    if not callable(loss_fn):
        raise ValueError(f"pipeline_layers: loss_fn {loss_fn!r} is not callable; give loss_fn(output, labels)")
    return PipelineLayers(tuple(layers), loss_fn)


def _built(layer: Any) -> Any:
    return layer.build() if hasattr(layer, "build") and hasattr(layer, "typename") else layer  # a LayerSpec


def sequential_with_loss(spec: PipelineLayers) -> Any:
    """The layers as one module (``parallel.pipeline = 1``): ``forward(inputs, labels)`` returns the loss."""
    from torch import nn

    class SequentialWithLoss(nn.Sequential):
        """``nn.Sequential`` of the layers whose forward ends in the loss (not a child module: names stay
        ``"<index>.<name>"``)."""

        def forward(self, inputs: Any, labels: Any) -> Any:  # type: ignore[override]
            output = inputs
            for layer in self:
                output = layer(output)
            return spec.loss_fn(output, labels)

    return SequentialWithLoss(*(_built(layer) for layer in spec.layers))


def build_pipeline(spec: PipelineLayers, topology: Any, tp_group: Any, local_rank: int) -> Any:
    """The layers as a DeepSpeed ``PipelineModule`` over ``topology`` (ValueError for a layout DeepSpeed's
    pipeline engine cannot express, as for the built-in GPT)."""
    from deepspeed.pipe import PipelineModule

    from hpc_train.rank.train.dscomm import init_deepspeed_comm
    from hpc_train.rank.train.pipeline import deepspeed_topology, mark_replicated

    ds_topology = deepspeed_topology(topology)
    init_deepspeed_comm(local_rank)  # PipelineModule talks through deepspeed.comm: adopt our group
    if len(spec.layers) < topology.sizes["pp"]:
        raise ValueError(f"{len(spec.layers)} layers cannot fill parallel.pipeline = {topology.sizes['pp']} stages; "
                         f"use at most {len(spec.layers)} stages")
    model = PipelineModule(layers=list(spec.layers), topology=ds_topology, loss_fn=spec.loss_fn,
                           partition_method="parameters")
    mark_replicated(model, tp_group)
    return model
