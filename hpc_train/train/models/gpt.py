"""The built-in GPT (:mod:`hpc_train.train.model`, its pipeline form :mod:`hpc_train.train.pipeline`) as the
trainer's one :class:`~hpc_train.train.models.spec.ModelSpec`: its shapes are the presets of
:data:`hpc_train.config.job.MODEL_PRESETS`. torch is imported inside the functions that build or count."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_train.config.job import MODEL_PRESETS
from hpc_train.train.models.spec import ModelSpec, Param, require_positive

if TYPE_CHECKING:
    from hpc_train.config.job import JobConfig
    from hpc_train.distributed.context import RankContext
    from hpc_train.distributed.mesh import ParallelGroups
    from hpc_train.distributed.topology import Topology
    from hpc_train.train.model import GPTConfig

__all__ = ["GPT_SPEC", "stage_parameters"]


def _shape(config: JobConfig) -> GPTConfig:
    from hpc_train.train.model import GPTConfig

    return GPTConfig.from_preset(config.train.model, config.data.vocab_size, config.train.seq_len)


def _build(ctx: RankContext, topology: Topology, groups: ParallelGroups) -> Any:
    """The GPT, or its pipeline stages. The layers always get the tensor group, even of size 1: they read None
    as "the default group", which would be every rank."""
    from hpc_train.train.model import GPT

    shape, seed = _shape(ctx.config), ctx.config.train.seed
    if topology.sizes["pp"] > 1:
        from hpc_train.train.pipeline import build_pipeline_model

        return build_pipeline_model(shape, topology, groups.group("tp"), seed=seed, local_rank=ctx.local_rank)
    return GPT(shape, groups.group("tp"), seed=seed)


def _flops_per_token(config: JobConfig, model: Any = None) -> float:
    """6N + 12LHT, with N the parameters of matrix multiplies: neither the position nor the (untied) input
    embedding (counted from the shape: ``model`` is not needed)."""
    from hpc_train.runtime.flops import flops_per_token
    from hpc_train.train.model import count_parameters

    shape = _shape(config)
    matmul_params = count_parameters(shape) - (shape.vocab_size + shape.seq_len) * shape.hidden
    return flops_per_token(matmul_params, shape.layers, shape.hidden, config.train.seq_len)


def _parameter_name(name: str, layers: int) -> str:
    from hpc_train.train.pipeline import gpt_parameter_name

    return gpt_parameter_name(name, layers)


def stage_parameters(preset: str, vocab_size: int, seq_len: int, tensor: int = 1,
                     pipeline: int = 1) -> list[list[Param]]:
    """The parameters one tensor-parallel rank of each pipeline stage holds, in ``model.parameters()`` order.

    Mirrors :class:`hpc_train.train.model.GPT` without importing torch; the tests check it against the real model.
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"model preset {preset!r} is unknown; use one of {', '.join(MODEL_PRESETS)}")
    require_positive(vocab_size=vocab_size, seq_len=seq_len, tensor=tensor, pipeline=pipeline)
    shape = MODEL_PRESETS[preset]
    layers, heads, h = shape["layers"], shape["heads"], shape["hidden"]
    if heads % tensor:
        raise ValueError(f"tensor = {tensor} does not divide the {heads} attention heads of {preset}; "
                         "use a tensor size that divides them")
    if vocab_size % tensor:
        raise ValueError(f"vocab_size = {vocab_size} is not divisible by tensor = {tensor}; pad the vocabulary to "
                         f"a multiple of {tensor} (e.g. {-(-vocab_size // tensor) * tensor})")
    if pipeline > layers:
        raise ValueError(f"pipeline = {pipeline} stages for the {layers} layers of {preset}; use at most {layers}")
    t = tensor

    def block(i: int) -> list[Param]:
        p = f"blocks.{i}."
        return [Param(p + "ln1.weight", h, False), Param(p + "ln1.bias", h, False),
                Param(p + "attn.qkv.weight", 3 * h * h // t, True), Param(p + "attn.qkv.bias", 3 * h // t, False),
                Param(p + "attn.proj.weight", h * h // t, True), Param(p + "attn.proj.bias", h, False),
                Param(p + "ln2.weight", h, False), Param(p + "ln2.bias", h, False),
                Param(p + "mlp.fc.weight", 4 * h * h // t, True), Param(p + "mlp.fc.bias", 4 * h // t, False),
                Param(p + "mlp.proj.weight", 4 * h * h // t, True), Param(p + "mlp.proj.bias", h, False)]

    counts = [layers // pipeline + (1 if i < layers % pipeline else 0) for i in range(pipeline)]
    stages: list[list[Param]] = []
    first = 0
    for index, count in enumerate(counts):
        params: list[Param] = []
        if index == 0:
            params += [Param("wte.weight", vocab_size // t * h, True), Param("wpe.weight", seq_len * h, True)]
        for i in range(first, first + count):
            params += block(i)
        if index == pipeline - 1:
            params += [Param("ln_f.weight", h, False), Param("ln_f.bias", h, False),
                       Param("head.weight", vocab_size // t * h, True)]
        stages.append(params)
        first += count
    return stages


GPT_SPEC = ModelSpec(name="gpt", build=_build, flops_per_token=_flops_per_token, stage_parameters=stage_parameters,
                     parameter_name=_parameter_name)
