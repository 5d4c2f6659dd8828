"""Your own model behind the trainer's seam: ``[train] model = "package.module:factory"`` or
``"path/to/file.py:factory"``, where ``factory(ctx)`` returns a ``torch.nn.Module``.

The factory is imported when the spec is made, before the rank joins the job, so a typo fails in a second;
it is called after the bootstrap with the rank's :class:`~hpc_train.distributed.context.RankContext` (the
groups for tensor-parallel layers, the device, ``ctx.config.train`` and ``ctx.params``), with torch seeded by
``train.seed`` so that every rank builds the same weights. FLOPs per token, for
MFU, are the module's own ``flops_per_token(seq_len)`` when it has one, else 6N (N the parameters: a forward
and a backward through each weight, no attention term). torch is imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_train.config.program import parse_entry_point
from hpc_train.train.entry_points import UserCodeError, load_callable
from hpc_train.train.models.spec import ModelSpec, Param

if TYPE_CHECKING:
    from hpc_train.config.job import JobConfig
    from hpc_train.distributed.context import RankContext
    from hpc_train.distributed.mesh import ParallelGroups
    from hpc_train.distributed.topology import Topology

__all__ = ["count_parameters", "user_spec"]


def count_parameters(model: Any, tensor: int = 1) -> int:
    """Parameters of the whole model from one rank's module: a ZeRO-3 partition counts whole (``ds_numel``),
    a tensor-parallel shard (marked ``tensor_model_parallel``, as hpc_train's layers do) ``tensor`` times."""
    total = 0
    for param in model.parameters():
        numel = int(getattr(param, "ds_numel", param.numel()))
        total += numel * (tensor if getattr(param, "tensor_model_parallel", False) else 1)
    return total


def _checked(model: Any, said: str, pipelined: bool) -> Any:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise UserCodeError(f"{said}: the factory returned {type(model).__name__}, not a torch.nn.Module; return "
                            "the model itself (hpc_train wraps it in DeepSpeed)")
    if not any(param.requires_grad for param in model.parameters()):
        raise UserCodeError(f"{said}: the factory returned a {type(model).__name__} with no trainable parameters")
    if pipelined:
        raise UserCodeError(f"{said}: parallel.pipeline > 1 needs a pipeline the model can be cut into, which "
                            "hpc_train builds for its GPT only; set parallel.pipeline = 1 (ZeRO and tensor "
                            "parallelism work with your model)")
    return model


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
            model = factory(ctx)
        except Exception as error:
            raise UserCodeError(f"{said}: the factory raised {type(error).__name__}: {error}", error) from error
        _checked(model, said, topology.sizes["pp"] > 1)
        # Dropout: one stream per data-parallel replica, shared by its tensor-parallel ranks (their activations
        # outside the sharded layers are replicated and must stay equal); a checkpoint saves and restores it.
        torch.manual_seed(seed + 1 + groups.coord("dp"))
        return model

    def flops_per_token(config: JobConfig, model: Any) -> float:
        own = getattr(model, "flops_per_token", None)
        if callable(own):
            return float(own(config.train.seq_len))
        return 6.0 * count_parameters(model, config.parallel.tensor)

    def stage_parameters(*_: Any) -> list[list[Param]]:
        raise ValueError(f"{said}: the login node cannot list your model's parameters; set [train] parameters = N")

    return ModelSpec(name=entry, build=build, flops_per_token=flops_per_token, stage_parameters=stage_parameters,
                     parameter_name=lambda name, layers: name)
