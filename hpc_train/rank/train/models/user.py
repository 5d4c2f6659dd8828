"""Your own model behind the trainer's seam: ``[train] model = "package.module:factory"`` or
``"path/to/file.py:factory"``, where ``factory(ctx)`` returns a ``torch.nn.Module``.

The factory is imported when the spec is made, before the rank joins the job, so a typo fails in a second;
it is called after the bootstrap with the rank's :class:`~hpc_train.rank.distributed.context.RankContext` (the
groups for tensor-parallel layers, the device, ``ctx.config.train`` and ``ctx.params``), with torch seeded by
``train.seed`` so that every rank builds the same weights. FLOPs per token, for
MFU, are the module's own ``flops_per_token(seq_len)`` when it has one, else 6N (N the parameters: a forward
and a backward through each weight, no attention term). A factory that returns
:func:`~hpc_train.rank.train.pipeline_layers.pipeline_layers` can also run with ``parallel.pipeline > 1``. torch is
imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_train.config.program import parse_entry_point
from hpc_train.rank.runtime.entry_points import UserCodeError, load_callable
from hpc_train.rank.train.models.spec import ModelSpec, Param

if TYPE_CHECKING:
    from hpc_train.common.topology import Topology
    from hpc_train.config.job import JobConfig
    from hpc_train.rank.distributed.context import RankContext
    from hpc_train.rank.distributed.mesh import ParallelGroups

__all__ = ["count_parameters", "user_spec"]


def count_parameters(model: Any, tensor: int = 1) -> int:
    """Parameters of the whole model from one rank's module: a ZeRO-3 partition counts whole (``ds_numel``),
    a tensor-parallel shard (marked ``tensor_model_parallel``, as hpc_train's layers do) ``tensor`` times."""
    total = 0
    for param in model.parameters():
        numel = int(getattr(param, "ds_numel", param.numel()))
        total += numel * (tensor if getattr(param, "tensor_model_parallel", False) else 1)
    return total


def _whole_model_parameters(model: Any, tensor: int) -> int:
    """:func:`count_parameters`, summed over the pipeline's stages when ``model`` is one stage of a pipeline."""
    count = count_parameters(model, tensor)
    grid = getattr(model, "_grid", None)  # a DeepSpeed PipelineModule's: its pipeline group
    if grid is None or grid.get_pipe_parallel_world_size() == 1:
        return count
    import torch

    from hpc_train.rank.distributed.collectives import all_reduce_values

    return int(all_reduce_values([count], group=grid.get_pipe_parallel_group(), dtype=torch.int64)[0])


def _module(made: Any, said: str, ctx: RankContext, topology: Topology, groups: ParallelGroups) -> Any:
    """The factory's result as this rank's module: a module as it is, pipeline layers as one module or (with
    ``parallel.pipeline > 1``) a DeepSpeed ``PipelineModule``; UserCodeError for anything else."""
    import torch

    from hpc_train.rank.train.pipeline_layers import PipelineLayers, build_pipeline, sequential_with_loss

    pipelined = topology.sizes["pp"] > 1
    if isinstance(made, PipelineLayers):
        try:
            return build_pipeline(made, topology, groups.group("tp"), ctx.local_rank) if pipelined \
                else sequential_with_loss(made)
        except (ValueError, TypeError) as error:
            raise UserCodeError(f"{said}: its pipeline layers cannot be built: {error}", error) from error
    if not isinstance(made, torch.nn.Module):
        raise UserCodeError(f"{said}: the factory returned {type(made).__name__}, not a torch.nn.Module; return "
                            "the model itself (hpc_train wraps it in DeepSpeed)")
    if pipelined:
        raise UserCodeError(f"{said}: parallel.pipeline > 1 needs the model as layers: return "
                            "hpc_train.rank.train.pipeline_layers.pipeline_layers(layers, loss_fn) from the factory, "
                            "or set parallel.pipeline = 1 (ZeRO and tensor parallelism work with any module)")
    return made


def _check_trainable(model: Any, said: str) -> None:
    if not any(param.requires_grad for param in model.parameters()):
        raise UserCodeError(f"{said}: the factory returned a {type(model).__name__} with no trainable parameters")


def user_spec(entry: str) -> ModelSpec:
    """The spec of the factory ``entry`` names (already checked on the login node), imported now."""
    program = parse_entry_point("train.model", entry)
    factory = load_callable("train.model", program, ("ctx",))
    said = f"train.model {entry}"

    def build(ctx: RankContext, topology: Topology, groups: ParallelGroups) -> Any:
        import torch

        seed = ctx.config.train.seed
        torch.manual_seed(seed)  # the same initial weights on every rank, whatever the factory draws
        try:
            made = factory(ctx)
        except Exception as error:
            raise UserCodeError(f"{said}: the factory raised {type(error).__name__}: {error}", error) from error
        model = _module(made, said, ctx, topology, groups)
        _check_trainable(model, said)
        # Dropout: one stream per data-parallel replica, shared by its tensor-parallel ranks (their activations
        # outside the sharded layers are replicated and must stay equal); a checkpoint saves and restores it.
        torch.manual_seed(seed + 1 + groups.coord("dp"))
        return model

    def flops_per_token(config: JobConfig, model: Any) -> float:
        """Collective for a pipeline (each stage holds its own layers: the count is summed over the stages)."""
        own = getattr(model, "flops_per_token", None)
        if callable(own):
            return float(own(config.train.seq_len))
        return 6.0 * _whole_model_parameters(model, config.parallel.tensor)

    def stage_parameters(*_: Any) -> list[list[Param]]:
        raise ValueError(f"{said}: the login node cannot list your model's parameters; set [train] parameters = N")

    return ModelSpec(name=entry, build=build, flops_per_token=flops_per_token, stage_parameters=stage_parameters,
                     parameter_name=lambda name, layers: name)
