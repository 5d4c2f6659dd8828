"""The one interface between the generic trainer and a model family: what the loop, the FLOP count, the memory
plan and the checkpoint export need to know about a model, and nothing else.

Pure Python (no torch at import): the login node's memory plan reads :attr:`ModelSpec.stage_parameters`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc_train.config.model_shapes import Param, require_positive

if TYPE_CHECKING:
    from hpc_train.common.topology import Topology
    from hpc_train.config.job import JobConfig
    from hpc_train.rank.distributed.context import RankContext
    from hpc_train.rank.distributed.mesh import ParallelGroups

__all__ = ["ModelSpec", "Param", "require_positive"]


@dataclass(frozen=True)
class ModelSpec:
    """A model family the trainer can run.

    * ``build(ctx, topology, groups)``: this rank's module (``ctx`` is the rank's
      :class:`~hpc_train.rank.distributed.context.RankContext`, with ``ctx.config``), a plain ``nn.Module`` called as
      ``model(*batch)`` for a tuple batch or ``model(**batch)`` for a dict, returning the loss (or an object or
      dict with a ``loss``), or (``parallel.pipeline > 1``) a DeepSpeed ``PipelineModule``. Tensor-parallel
      layers get ``groups.group("tp")``.
    * ``flops_per_token(config, model)``: training FLOPs per token of the whole model, for MFU (``model`` is
      what ``build`` returned, before DeepSpeed wraps it).
    * ``stage_parameters(preset, vocab_size, seq_len, tensor, pipeline)``: the parameters one tensor-parallel rank
      of each pipeline stage holds, in ``parameters()`` order, for the memory plan (pure Python).
    * ``parameter_name(name, layers)``: the plain model's name of a pipeline checkpoint's ``"<layer>.<name>"``,
      for export.
    """

    name: str
    build: Callable[[RankContext, Topology, ParallelGroups], Any]
    flops_per_token: Callable[[JobConfig, Any], float]
    stage_parameters: Callable[[str, int, int, int, int], list[list[Param]]]
    parameter_name: Callable[[str, int], str]
