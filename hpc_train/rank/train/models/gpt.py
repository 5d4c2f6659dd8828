"""The built-in GPT (:mod:`hpc_train.rank.train.model`, its pipeline form :mod:`hpc_train.rank.train.pipeline`) as the
trainer's one :class:`~hpc_train.rank.train.models.spec.ModelSpec`: its shapes are the presets of
:data:`hpc_train.config.job.MODEL_PRESETS`. torch is imported inside the functions that build or count."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_train.config.model_shapes import gpt_parameter_name
from hpc_train.config.model_shapes import gpt_stage_parameters as stage_parameters
from hpc_train.rank.train.models.spec import ModelSpec

if TYPE_CHECKING:
    from hpc_train.common.topology import Topology
    from hpc_train.config.job import JobConfig
    from hpc_train.rank.distributed.context import RankContext
    from hpc_train.rank.distributed.mesh import ParallelGroups
    from hpc_train.rank.train.model import GPTConfig

__all__ = ["GPT_SPEC", "stage_parameters"]


def _shape(config: JobConfig) -> GPTConfig:
    from hpc_train.rank.train.model import GPTConfig

    return GPTConfig.from_preset(config.train.model, config.data.vocab_size, config.train.seq_len)


def _build(ctx: RankContext, topology: Topology, groups: ParallelGroups) -> Any:
    """The GPT, or its pipeline stages. The layers always get the tensor group, even of size 1: they read None
    as "the default group", which would be every rank."""
    from hpc_train.rank.train.model import GPT

    shape, seed = _shape(ctx.config), ctx.config.train.seed
    if topology.sizes["pp"] > 1:
        from hpc_train.rank.train.pipeline import build_pipeline_model

        return build_pipeline_model(shape, topology, groups.group("tp"), seed=seed, local_rank=ctx.local_rank)
    return GPT(shape, groups.group("tp"), seed=seed)


def _flops_per_token(config: JobConfig, model: Any = None) -> float:
    """6N + 12LHT, with N the parameters of matrix multiplies: neither the position nor the (untied) input
    embedding (counted from the shape: ``model`` is not needed)."""
    from hpc_train.rank.runtime.flops import flops_per_token
    from hpc_train.rank.train.model import count_parameters

    shape = _shape(config)
    matmul_params = count_parameters(shape) - (shape.vocab_size + shape.seq_len) * shape.hidden
    return flops_per_token(matmul_params, shape.layers, shape.hidden, config.train.seq_len)


GPT_SPEC = ModelSpec(name="gpt", build=_build, flops_per_token=_flops_per_token, stage_parameters=stage_parameters,
                     parameter_name=gpt_parameter_name)
