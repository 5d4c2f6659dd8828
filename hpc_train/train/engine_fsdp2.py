"""PyTorch FSDP2 (``fully_shard``) as the trainer's engine, beside DeepSpeed: the same loop, loss, schedule,
clipping, data path and checkpoint transaction.

The recipe of PyTorch's FSDP2 example and torchtitan: each block of the model is sharded on its own (the model
seam names them: a model's ``fsdp_blocks()``, the GPT's transformer blocks; else the classes a Hugging Face model
lists in ``_no_split_modules``; else its top-level children that share no parameter with another), then the root,
which keeps what is left (embeddings, the head, and weights tied between them, so tied weights are in one group).
Sharding runs on the data axis of hpc_train's DeviceMesh, passed explicitly (a CPU mesh on gloo, so a machine
with GPUs never gets a CUDA mesh under gloo). bf16 computes in bf16 and reduces gradients in fp32
(``MixedPrecisionPolicy``); the sharded parameters and the optimizer stay fp32. The optimizer is built after
sharding, on the DTensor parameters, with the weight-decay groups and schedule of the DeepSpeed path.

Left for later (docs/training.md says so): building on the meta device and materialising with ``to_empty`` (the
model is built whole on each rank first, as for DeepSpeed, so both start from the same weights), and tensor
parallelism on a 2-D mesh.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hpc_train.config.plan import Plan
from hpc_train.distributed.mesh import ParallelGroups
from hpc_train.train.engine import lr_at, weight_decay_groups

__all__ = ["Fsdp2Engine", "fsdp_blocks"]


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one before the root (see the module doc)."""
    own = getattr(model, "fsdp_blocks", None)
    if callable(own):
        return list(own())
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [module for module in model.modules() if type(module).__name__ in names]
    children = [child for child in model.children() if any(True for _ in child.parameters())]
    holders: dict[int, set[int]] = {}
    for index, child in enumerate(children):
        for param in child.parameters():
            holders.setdefault(id(param), set()).add(index)
    tied = {index for owners in holders.values() if len(owners) > 1 for index in owners}
    return [child for index, child in enumerate(children) if index not in tied]


def _mixed_precision(precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class Fsdp2Engine:
    """The trainer's :class:`~hpc_train.train.engines.Stepping` over a ``fully_shard`` model: the forward is the
    model's, ``backward`` scales the loss by the accumulation (as DeepSpeed does), and ``step`` on the last
    micro-batch of a step clips, steps AdamW and the schedule, and zeroes the gradients."""

    def __init__(self, model: nn.Module, plan: Plan, groups: ParallelGroups, device: torch.device) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        config = plan.config
        train, fsdp = config.train, config.fsdp
        self.device = device
        mesh = groups.mesh["dp"]
        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": fsdp.reshard_after_forward,
                                   "mp_policy": _mixed_precision(train.precision)}
        if fsdp.offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for block in fsdp_blocks(model):
            fully_shard(block, **options)
        self.module = fully_shard(model, **options)
        self.optimizer = torch.optim.AdamW(weight_decay_groups(model, train.weight_decay), lr=train.lr,
                                           betas=(train.beta1, train.beta2), eps=train.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_at(step, train) / train.lr)
        self.grad_accum = train.grad_accum
        self.grad_clip = train.grad_clip
        self._micro = 0
        self._norm: float | None = None

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        return self.module(*inputs, **named)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self.grad_accum:
            return
        # The norm before clipping over every rank's shards (a DTensor: its full value is one all-reduce).
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip or math.inf)
        self._norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._norm

    def train(self, mode: bool = True) -> Fsdp2Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Fsdp2Engine:
        self.module.eval()
        return self
