"""Deterministic weights for the tensor-parallel layers: each layer draws its FULL weight on the CPU from a seeded
generator, so every tensor size starts from the same numbers, and draws it again after FSDP2's meta build
(``reset_parameters``) into parameters that may be sharded by then."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["InitMethod", "fill_parameter", "full_weight", "init_normal", "replayable"]

#: Fills a full (unsharded) weight in place, drawing every random number from the given generator.
InitMethod = Callable[[torch.Tensor, torch.Generator], Any]


def init_normal(std: float = 0.02, mean: float = 0.0) -> InitMethod:
    """Return an init method drawing N(mean, std²) from the given generator (the Megatron default, std 0.02)."""

    def init(weight: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(weight, mean=mean, std=std, generator=generator)

    return init


def full_weight(shape: tuple[int, ...], init_method: InitMethod | None, seed: int | torch.Generator,
                 dtype: torch.dtype) -> torch.Tensor:
    """Draw the full weight on the CPU in float32 (same numbers for every dtype, device and TP size). Under
    ``torch.device("meta")`` (FSDP2's meta build) nothing is drawn: ``reset_parameters`` draws it later."""
    if torch.get_default_device().type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    weight = torch.empty(shape, dtype=torch.float32)
    (init_method or init_normal())(weight, generator)
    return weight.to(dtype)


def fill_parameter(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` (the whole parameter, on the CPU) into ``param`` in place: a DTensor that FSDP2 sharded
    takes its own part of it (every rank has the same ``value``, so nothing is sent), a plain tensor all of it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    with torch.no_grad():
        if dtensor is not None and isinstance(param, dtensor.DTensor):
            part = dtensor.distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                             param.placements, src_data_rank=None)
            param.to_local().copy_(part.to_local())
        else:
            param.copy_(value)


def replayable(seed: int | torch.Generator, owner: str) -> int:
    if isinstance(seed, torch.Generator):
        raise RuntimeError(f"{owner} was built with a shared torch.Generator, so its weights cannot be drawn "
                           "again (reset_parameters); give it an integer seed")
    return seed
