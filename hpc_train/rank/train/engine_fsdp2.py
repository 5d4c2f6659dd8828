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

With ``[parallel] tensor > 1`` the model's tensor-parallel layers keep their shards and their own collectives on
the tensor group; each sharded parameter (marked by the layers with its ``partition_dim``) becomes a DTensor on
the tensor axis of the same mesh before sharding, so ``fully_shard`` on the data axis makes it a 2-D DTensor and
a checkpoint knows its full shape (DCP then reshards on either axis). The gradient norm counts each shard once
and each replica once (:func:`global_grad_norm`).

The built-in GPT is built on the meta device (``fsdp.meta_init``, the default with ``parallel.tensor = 1``):
``fully_shard`` then works on shapes alone, ``to_empty`` gives each rank memory for its own shards, and the GPT's
``init_weights`` draws the numbers a whole build draws, one parameter at a time, each rank keeping its part. No
rank holds the whole model, and the run starts bit for bit where a whole build starts. Other models, and tensor
parallelism, are built whole on each rank first, as for DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hpc_train.config.plan import Plan
from hpc_train.rank.distributed.collectives import all_reduce_values
from hpc_train.rank.distributed.mesh import ParallelGroups
from hpc_train.rank.train.engine import lr_at, weight_decay_groups

__all__ = ["Fsdp2Engine", "fsdp_blocks", "global_grad_norm", "tensor_parallel_dtensors"]


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


def tensor_parallel_dtensors(model: nn.Module, tensor_mesh: Any) -> int:
    """Make each parameter the tensor-parallel layers marked (``tensor_model_parallel`` with ``partition_dim``) a
    DTensor sharded on ``tensor_mesh``, in place; the layers compute on its local shard. Returns how many."""
    from torch.distributed.tensor import DTensor, Shard

    count = 0
    for owner_name, owner in model.named_modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if not getattr(param, "tensor_model_parallel", False) or isinstance(param, DTensor):
                continue
            dim = getattr(param, "partition_dim", None)
            if dim is None:
                raise ValueError(f"{owner_name}.{name} is marked tensor-parallel without a partition_dim: FSDP2 "
                                 "needs the dimension it is split along (hpc_train's tensor_parallel layers set it)")
            shard = DTensor.from_local(param.data, tensor_mesh, [Shard(dim)], run_check=False)
            setattr(owner, name, nn.Parameter(shard, requires_grad=param.requires_grad))
            count += 1
    return count


def _replicas(tensor: torch.Tensor, world: int) -> int:
    """How many ranks of ``world`` hold the same values as this rank's local part of ``tensor``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return world
    shards = 1
    for axis, placement in enumerate(tensor.placements):
        if not (placement.is_replicate() or placement.is_partial()):  # Shard and _StridedShard
            shards *= tensor.device_mesh.size(axis)
    return world // shards


def global_grad_norm(params: list[torch.Tensor], group: Any, device: torch.device) -> float:
    """The 2-norm of every gradient over ``group`` (the data and tensor ranks): each rank's local squares, each
    divided by the number of ranks holding the same part, summed in one all-reduce. A parameter that is a DTensor
    on the data axis alone is whole on every tensor rank, and counts once. The caller reads the norm as a number
    anyway (to clip and to log), so the sum travels as one through the group's device."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        part = grad.to_local() if hasattr(grad, "to_local") else grad
        total += part.float().pow(2).sum() / _replicas(grad, world)
    (summed,) = all_reduce_values([float(total)], group=group)
    return math.sqrt(summed)


def _mixed_precision(precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class Fsdp2Engine:
    """The trainer's :class:`~hpc_train.rank.train.engines.Stepping` over a ``fully_shard`` model: the forward is the
    model's, ``backward`` scales the loss by the accumulation (as DeepSpeed does), and ``step`` on the last
    micro-batch of a step clips, steps AdamW and the schedule, and zeroes the gradients."""

    def __init__(self, model: nn.Module, plan: Plan, groups: ParallelGroups, device: torch.device) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        config = plan.config
        train, fsdp = config.train, config.fsdp
        self.device = device
        if groups.size("tp") > 1:
            tensor_parallel_dtensors(model, groups.mesh["tp"])
        mesh = groups.mesh["dp"]
        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": fsdp.reshard_after_forward,
                                   "mp_policy": _mixed_precision(train.precision)}
        if fsdp.offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for block in fsdp_blocks(model):
            fully_shard(block, **options)
        self.module = fully_shard(model, **options)
        if any(param.is_meta for param in model.parameters()):  # the meta build: memory for this rank's shards
            model.to_empty(device="cpu" if fsdp.offload else device)
            model.init_weights()  # the whole build's numbers, a parameter at a time
        self.norm_group = None  # the world: FSDP2 trains data x tensor only (validate refuses pipeline, context)
        # One step per tensor with tensor parallelism: a foreach step (CUDA's default) takes one DTensor mesh per
        # call, and the parameters are on two (data x tensor, data alone). Splitting the groups by mesh instead
        # would tie a checkpoint's optimizer groups to the tensor size it was saved at.
        self.optimizer = torch.optim.AdamW(weight_decay_groups(model, train.weight_decay), lr=train.lr,
                                           betas=(train.beta1, train.beta2), eps=train.eps,
                                           foreach=False if groups.size("tp") > 1 else None)
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
        # The norm before clipping, over every rank's shards; clipped as torch's clip_grad_norm_ does.
        params = [param for param in self.module.parameters() if param.grad is not None]
        self._norm = global_grad_norm(params, self.norm_group, self.device)
        if self.grad_clip:
            scale = min(1.0, self.grad_clip / (self._norm + 1e-6))
            if scale < 1.0:
                for param in params:
                    param.grad.mul_(scale)
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
