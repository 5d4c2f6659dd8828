"""One forward pass of any model on any batch, and its loss.

The contract of ``[train] model``: a dict batch is passed as keywords (``model(**batch)``, so a Hugging Face
``...ForCausalLM`` with ``labels`` works as it is), a tuple or list as positional arguments, anything else as
one argument; the model returns the loss, a scalar tensor, or an object or dict holding it as ``loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hpc_train.rank.runtime.entry_points import UserCodeError

__all__ = ["forward_loss", "loss_of"]


def loss_of(output: Any, said: str) -> torch.Tensor:
    """The scalar loss in a forward's ``output``; UserCodeError naming ``said`` (the model) and what it gave."""
    loss = output
    if not isinstance(output, torch.Tensor):
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None:
            raise UserCodeError(f"{said}: the forward returned {type(output).__name__} with no loss; return the "
                                "loss, or an object or dict with a 'loss' (a Hugging Face model computes one when "
                                "the batch has labels)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UserCodeError(f"{said}: the forward's loss is {shape}, not a scalar tensor; reduce it (loss.mean())")
    return loss.reshape(())


def forward_loss(model: Any, batch: Any, said: str) -> torch.Tensor:
    """``model`` called on ``batch`` by the contract above; its loss."""
    if isinstance(batch, Mapping):
        output = model(**batch)
    elif isinstance(batch, list | tuple):
        output = model(*batch)
    else:
        output = model(batch)
    return loss_of(output, said)
