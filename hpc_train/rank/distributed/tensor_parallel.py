"""Tensor-parallel building blocks in the style of Megatron-LM: sharded linear layers, embedding and cross entropy.

Why: a layer too large (or too slow) for one device is split across the ranks of a tensor-parallel (TP) group.
A column-parallel linear keeps a slice of the output features on each rank and a row-parallel linear a slice of
the input features, so an MLP block (column, then row) needs only one all-reduce forward and one backward. The
vocabulary of the embedding and of the output layer is split the same way, and the cross entropy is computed on
the vocabulary shards without ever gathering the full logits (the largest activation of a language model).

Design rules of this module:

* No module-level state. Every function and layer takes the TP process group explicitly: a
  ``torch.distributed.ProcessGroup``, or ``None`` for the default group. When ``torch.distributed`` is not
  initialised, ``None`` means a single rank, so the same model code runs unsharded in one process.
* Deterministic initialisation: each layer draws its FULL weight on the CPU from a seeded generator (identical
  on every rank) and keeps its own shard. A TP=N model therefore starts from exactly the weights of TP=1, and
  fan-in/fan-out based initialisers see the true layer shape. The cost is one temporary full-size weight per
  layer on each rank at construction.
* Shards are contiguous: rank ``r`` of ``N`` owns rows/columns ``[r * size / N, (r + 1) * size / N)``.
  ``copy_from_full`` loads a full weight into the shards and ``gather_full`` rebuilds it (for tests,
  checkpoint conversion and loading unsharded weights).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the usual alias)
from torch import nn

from hpc_train.rank.distributed.tp_init import InitMethod, fill_parameter, full_weight, init_normal, replayable

__all__ = [
    "ColumnParallelLinear",
    "InitMethod",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "fill_parameter",
    "gather_from_tensor_parallel_region",
    "gather_tensor",
    "init_normal",
    "local_shard",
    "mark_sharded",
    "partition_size",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "shard_range",
    "shard_tensor",
    "tp_rank",
    "tp_world_size",
    "vocab_parallel_cross_entropy",
]

Group = dist.ProcessGroup | None


# ---------------------------------------------------------------------------------------------------------------
# Group geometry and sharding
# ---------------------------------------------------------------------------------------------------------------

def _single_process(group: Group) -> bool:
    return group is None and not (dist.is_available() and dist.is_initialized())


def tp_world_size(group: Group) -> int:
    """Number of ranks in the TP group (1 when ``group`` is None and torch.distributed is not initialised)."""
    return 1 if _single_process(group) else dist.get_world_size(group)


def tp_rank(group: Group) -> int:
    """This process's rank inside the TP group (0 when ``group`` is None and torch.distributed is not initialised)."""
    return 0 if _single_process(group) else dist.get_rank(group)


def partition_size(total: int, tp_size: int, *, name: str = "size", owner: str = "", fix: str = "") -> int:
    """Return ``total // tp_size``; raise ValueError naming both sizes and the fix when it does not divide.

    ``fix`` is the start of the advice, e.g. ``"pad the vocabulary to"``; the multiple to use is appended.
    """
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp_size}")
    if total % tp_size:
        suggestion = -(-total // tp_size) * tp_size
        prefix = f"{owner}: " if owner else ""
        advice = fix or f"make {name}"
        raise ValueError(
            f"{prefix}{name}={total} is not divisible by the tensor-parallel size {tp_size}; "
            f"{advice} a multiple of {tp_size} (e.g. {suggestion}) or use a tensor-parallel size that divides "
            f"{total}")
    return total // tp_size


def shard_range(total: int, group: Group, *, name: str = "size") -> tuple[int, int]:
    """``[start, end)`` of this rank's contiguous shard of ``total`` items (ValueError when not divisible)."""
    part = partition_size(total, tp_world_size(group), name=name)
    start = tp_rank(group) * part
    return start, start + part


def shard_tensor(full: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous shard of ``full`` along ``dim``, as a new contiguous tensor (no autograd)."""
    start, end = shard_range(full.size(dim), group, name=f"dim {dim} of the full tensor")
    return full.detach().narrow(dim, start, end - start).clone(memory_format=torch.contiguous_format)


def gather_tensor(shard: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (a collective; no autograd). Inverse of :func:`shard_tensor`."""
    shard = shard.detach().contiguous()
    if tp_world_size(group) == 1:
        return shard.clone()
    parts = [torch.empty_like(shard) for _ in range(tp_world_size(group))]
    dist.all_gather(parts, shard, group=group)
    return torch.cat(parts, dim=dim)


def _all_reduce(tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place (it must be a tensor this module owns) and return it."""
    if tp_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _split_last_dim(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    size = tp_world_size(group)
    if size == 1:
        return tensor
    part = partition_size(tensor.size(-1), size, name="last dimension", owner="scatter_to_tensor_parallel_region")
    start = tp_rank(group) * part
    return tensor.narrow(-1, start, part).contiguous()


def _gather_last_dim(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    size = tp_world_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# Autograd functions for the collectives
# ---------------------------------------------------------------------------------------------------------------

class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (every rank used the same input)."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Cloned: autograd may hand the same gradient tensor to another branch of the graph.
        grad = grad_output.clone(memory_format=torch.contiguous_format)
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward (sum of the partial results); identity backward."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(input_.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad_output, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _gather_last_dim(input_, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last_dim(grad_output, ctx.group), None


def copy_to_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter the TP region with a replicated input: identity forward, gradient all-reduced backward."""
    return _CopyToTensorParallelRegion.apply(input_, group)


def reduce_from_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave the TP region by summing partial results: all-reduce forward, identity backward."""
    return _ReduceFromTensorParallelRegion.apply(input_, group)


def scatter_to_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """Split the last dimension and keep this rank's slice forward; all-gather the gradient backward."""
    return _ScatterToTensorParallelRegion.apply(input_, group)


def gather_from_tensor_parallel_region(input_: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""
    return _GatherFromTensorParallelRegion.apply(input_, group)


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------

def mark_sharded(*params: nn.Parameter | None, dim: int = 0) -> None:
    """Tell DeepSpeed these parameters differ across the tensor group, so that gradient norms count each shard
    (the layers here mark their own; a parameter left unmarked is counted once, on tensor rank 0), and FSDP2
    along which dimension (``partition_dim``, Megatron's name) they are split, to make them tensor DTensors."""
    for param in params:
        if param is not None:
            param.model_parallel = True  # type: ignore[attr-defined]
            param.tensor_model_parallel = True  # type: ignore[attr-defined]
            param.partition_dim = dim  # type: ignore[attr-defined]


def local_shard(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a parameter: under FSDP2 with tensor parallelism the layers' parameters are DTensors
    on the tensor axis (so checkpoints know the full shapes), and the layers compute on the local shard."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (an import is 1 s)
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def _check_full_shape(what: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{what}: the full tensor has shape {tuple(tensor.shape)}, expected {expected}")


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W (out_features × in_features) split along the output dimension.

    Each rank holds ``out_features / tp`` rows of W and the matching slice of b. The input is replicated
    (its gradient is all-reduced); the output is this rank's slice of the features, or the full output when
    ``gather_output`` is set. The bias starts at zero.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod | None = None, *,
                 seed: int | torch.Generator = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output = group, gather_output
        self.tp_size = tp_world_size(group)
        self.out_features_per_partition = partition_size(
            out_features, self.tp_size, name="out_features", owner="ColumnParallelLinear")
        self._init = (init_method, seed, dtype)
        full = full_weight((out_features, in_features), init_method, seed, dtype)
        self.weight = nn.Parameter(shard_tensor(full, 0, group).to(device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features_per_partition, dtype=dtype,
                                                 device=self.weight.device))
        else:
            self.register_parameter("bias", None)
        mark_sharded(self.weight, self.bias)

    def reset_parameters(self) -> None:
        """Draw the weights again from the layer's seed, into parameters FSDP2 may have sharded (the meta build)."""
        method, seed, dtype = self._init
        full = full_weight((self.out_features, self.in_features), method, replayable(seed, "ColumnParallelLinear"),
                            dtype)
        fill_parameter(self.weight, shard_tensor(full, 0, self.group))
        if self.bias is not None:
            fill_parameter(self.bias, torch.zeros(self.out_features_per_partition, dtype=dtype))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Local slice of the output features (``[..., out_features / tp]``), or all of them if gathered."""
        input_ = copy_to_tensor_parallel_region(input_, self.group)
        output = F.linear(input_, local_shard(self.weight), local_shard(self.bias))
        return gather_from_tensor_parallel_region(output, self.group) if self.gather_output else output

    @torch.no_grad()
    def copy_from_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Load this rank's shard of a full weight (out_features × in_features) and bias (out_features)."""
        _check_full_shape("ColumnParallelLinear weight", weight, (self.out_features, self.in_features))
        self.weight.copy_(shard_tensor(weight, 0, self.group))
        if bias is not None and self.bias is not None:
            _check_full_shape("ColumnParallelLinear bias", bias, (self.out_features,))
            self.bias.copy_(shard_tensor(bias, 0, self.group))

    def gather_full(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full weight and bias (a collective: every rank of the group must call it)."""
        bias = None if self.bias is None else gather_tensor(self.bias, 0, self.group)
        return gather_tensor(self.weight, 0, self.group), bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_partition} per rank of {self.tp_size}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W (out_features × in_features) split along the input dimension.

    Each rank multiplies its slice of the input features by its columns of W; the partial outputs are
    all-reduced and the (replicated, zero-initialised) bias is added once, after the reduction. With
    ``input_is_parallel`` (the default, the output of a ColumnParallelLinear) the input is already this rank's
    slice; otherwise the full input is split here.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod | None = None, *,
                 seed: int | torch.Generator = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel = group, input_is_parallel
        self.tp_size = tp_world_size(group)
        self.in_features_per_partition = partition_size(
            in_features, self.tp_size, name="in_features", owner="RowParallelLinear")
        self._init = (init_method, seed, dtype)
        full = full_weight((out_features, in_features), init_method, seed, dtype)
        self.weight = nn.Parameter(shard_tensor(full, 1, group).to(device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=self.weight.device))
        else:
            self.register_parameter("bias", None)
        mark_sharded(self.weight, dim=1)  # the bias is whole on every rank

    def reset_parameters(self) -> None:
        """Draw the weights again from the layer's seed, into parameters FSDP2 may have sharded (the meta build)."""
        method, seed, dtype = self._init
        full = full_weight((self.out_features, self.in_features), method, replayable(seed, "RowParallelLinear"),
                            dtype)
        fill_parameter(self.weight, shard_tensor(full, 1, self.group))
        if self.bias is not None:
            fill_parameter(self.bias, torch.zeros(self.out_features, dtype=dtype))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Full output (``[..., out_features]``), identical on every rank of the group."""
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_parallel_region(input_, self.group)
        output = reduce_from_tensor_parallel_region(F.linear(input_, local_shard(self.weight)), self.group)
        return output if self.bias is None else output + self.bias

    @torch.no_grad()
    def copy_from_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Load this rank's columns of a full weight (out_features × in_features) and the whole bias."""
        _check_full_shape("RowParallelLinear weight", weight, (self.out_features, self.in_features))
        self.weight.copy_(shard_tensor(weight, 1, self.group))
        if bias is not None and self.bias is not None:
            _check_full_shape("RowParallelLinear bias", bias, (self.out_features,))
            self.bias.copy_(bias)

    def gather_full(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full weight and bias (a collective: every rank of the group must call it)."""
        bias = None if self.bias is None else self.bias.detach().clone()
        return gather_tensor(self.weight, 1, self.group), bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_partition} per rank of {self.tp_size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split into contiguous vocabulary ranges, one per rank.

    Each rank looks up the tokens of its range, writes zeros for the others, and the partial embeddings are
    all-reduced, so the output is the full embedding on every rank. Token ids outside ``[0, num_embeddings)``
    give a zero vector when TP > 1 (and an IndexError at TP = 1), as in Megatron.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group,
                 init_method: InitMethod | None = None, *, seed: int | torch.Generator = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.tp_size = tp_world_size(group)
        self.num_embeddings_per_partition = partition_size(
            num_embeddings, self.tp_size, name="num_embeddings", owner="VocabParallelEmbedding",
            fix="pad the vocabulary (unused ids) to")
        self.vocab_start = tp_rank(group) * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        self._init = (init_method, seed, dtype)
        full = full_weight((num_embeddings, embedding_dim), init_method, seed, dtype)
        self.weight = nn.Parameter(shard_tensor(full, 0, group).to(device))
        mark_sharded(self.weight)

    def reset_parameters(self) -> None:
        """Draw the table again from the layer's seed, into a parameter FSDP2 may have sharded (the meta build)."""
        method, seed, dtype = self._init
        full = full_weight((self.num_embeddings, self.embedding_dim), method,
                            replayable(seed, "VocabParallelEmbedding"), dtype)
        fill_parameter(self.weight, shard_tensor(full, 0, self.group))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[..., embedding_dim]`` of integer ids ``[...]``, identical on every rank."""
        if self.tp_size == 1:
            return F.embedding(input_ids, local_shard(self.weight))
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, local_shard(self.weight)).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(partial, self.group)

    @torch.no_grad()
    def copy_from_full(self, weight: torch.Tensor) -> None:
        """Load this rank's rows of a full table (num_embeddings × embedding_dim)."""
        _check_full_shape("VocabParallelEmbedding weight", weight, (self.num_embeddings, self.embedding_dim))
        self.weight.copy_(shard_tensor(weight, 0, self.group))

    def gather_full(self) -> torch.Tensor:
        """The full table (a collective: every rank of the group must call it)."""
        return gather_tensor(self.weight, 0, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
                f"on rank {tp_rank(self.group)} of {self.tp_size}")


# ---------------------------------------------------------------------------------------------------------------
# Cross entropy on vocabulary-parallel logits
# ---------------------------------------------------------------------------------------------------------------

class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split along the vocabulary (last) dimension.

    Forward: the maximum logit is all-reduced (MAX) for stability, then the partial sums of ``exp(logit - max)``
    and the target logit (taken by the rank whose range holds the target, zero elsewhere) are all-reduced
    together (SUM); ``loss = log(sum) - target_logit``. Backward: ``softmax - one_hot(target)`` on the local
    shard, scaled by the incoming gradient; no communication. Computed in at least float32; the loss is
    returned in that precision and the gradient in the dtype of the logits.
    """

    @staticmethod
    def forward(ctx: Any, logits_parallel: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
        if target.shape != logits_parallel.shape[:-1]:
            raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} does not match "
                             f"the logits shape {tuple(logits_parallel.shape)} without its last (vocabulary) dim")
        compute_dtype = torch.promote_types(logits_parallel.dtype, torch.float32)
        logits = logits_parallel.to(compute_dtype)  # may alias the input: only out-of-place ops on it below
        part = logits.size(-1)
        vocab_start = tp_rank(group) * part

        logits_max = _all_reduce(logits.amax(dim=-1), group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + part)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp_()
        sums = _all_reduce(torch.stack((exp.sum(dim=-1), target_logit)), group)  # one all-reduce for both
        sum_exp, target_logit = sums[0], sums[1]
        loss = torch.log(sum_exp) - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = logits_parallel.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax * grad_loss.unsqueeze(-1)  # new tensor: the saved softmax stays valid for retain_graph
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-grad_loss).masked_fill(outside, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits_parallel: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
    """Per-token losses (shape of ``target``) of logits whose last dimension is this rank's vocabulary shard.

    Rank ``r`` of ``N`` must hold vocabulary ids ``[r * V / N, (r + 1) * V / N)`` (the layout of
    ColumnParallelLinear without ``gather_output``). There is no ignore index: a target outside ``[0, V)``
    gives ``logsumexp`` of the logits, so mask such tokens out of the per-token losses before reducing.
    """
    return VocabParallelCrossEntropy.apply(logits_parallel, target, group)
