"""What PyTorch's FSDP2 (``fully_shard``) keeps per rank, as :mod:`hpc_train.rank.train.engine_fsdp2` applies it: the
FSDP2 half of the memory plan (:func:`hpc_train.config.memory.fsdp2_memory_plan`), pure Python like the rest.

Read in torch 2.13's ``torch/distributed/fsdp/_fully_shard/`` (``_fsdp_param.py``, ``_fsdp_param_group.py``,
``_fsdp_collectives.py``, ``_fsdp_state.py``) and measured by ``tests/config/test_memory.py``. hpc_train makes one
FSDP2 group of each transformer block, then the root of what is left (embeddings, final LayerNorm, head), with
``MixedPrecisionPolicy(bf16, reduce fp32)`` in bf16 and fp32 throughout otherwise.

* Shards. ``FSDPParam`` cuts each parameter (its tensor-parallel piece with ``tensor > 1``) along dim 0 into
  ``data`` chunks and every rank stores a chunk of the first one's size, ``ceil(rows / data)`` rows: padding.
  The shards stay fp32, gradient shards are fp32 (views of one reduce-scatter output per group), and AdamW's m
  and v live on them: 16 bytes per shard element and no master copy; bf16 exists only in the gathered copies.
* Gathered parameters. A group's parameters are all-gathered (every rank's padded shard, in the compute dtype)
  at its pre-forward and freed at its post-forward, and again for its backward. The root's forward is the
  whole forward pass, and its post-backward runs in the final callback (its input, the tokens, takes no
  gradient), so the root stays gathered through both passes. (torch skips the root's reshard after forward only
  when ``reshard_after_forward`` is left unset; hpc_train sets it.) With ``reshard_after_forward = false`` every
  block stays gathered from its forward to its backward. ``gathered`` is the peak of these parameters.
* Buffers beside them (``reduce_buffers``, the peak over both passes): each all-gather lands in a flat buffer,
  copied out into the parameters; in the forward pass the previous group's buffer is freed only after the next
  one is gathered, in the backward pass the next block is prefetched. A block's gradients are computed whole
  in the compute dtype, copied into an fp32 reduce-scatter input (``world x shard``, padded) and freed; that
  input is kept until the next block's reduce. The head's and final LayerNorm's gradients wait whole for the
  root's reduce at the end of the backward pass. ``step_buffers`` is AdamW's foreach ``sqrt(v)`` copy of its
  largest parameter group (of the largest tensor with ``tensor > 1``, where it steps tensor by tensor).
* ``fsdp.offload`` (``CPUOffloadPolicy``) keeps the shards, gradients and AdamW state in CPU memory (``cpu``) and
  steps there; the GPU holds the gathered groups and the reduction buffers, and 1/data-sized staging copies
  that are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_train.config.model_shapes import Param

__all__ = ["Fsdp2Held", "fsdp2_groups", "fsdp2_held", "shard_elements"]

REDUCE_BYTES = 4  # gradients are reduce-scattered in fp32 in both precisions hpc_train gives FSDP2


@dataclass(frozen=True)
class Fsdp2Held:
    """Bytes one rank holds (see the module docstring), and the notes that explain them."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    reduce_buffers: int
    step_buffers: int
    cpu: int
    notes: tuple[str, ...]


@dataclass(frozen=True)
class _Group:
    """One FSDP2 group at work, in bytes: its gathered parameters (every rank's padded shard, compute dtype), its
    unsharded gradients (compute dtype) and its reduce-scatter input (fp32, padded)."""

    gathered: int
    grads: int
    reduce: int


def _rows(p: Param, hidden: int) -> int:
    """Dim 0 of ``p``, the one FSDP2 cuts: the GPT's matrices are (out, hidden) but its row-parallel projections
    (hidden, in / tensor); vectors, and shapes the plan does not know (``hidden`` 0), are their own rows."""
    if not (p.matrix and hidden):
        return p.numel
    if p.name.endswith("proj.weight"):
        return hidden
    return p.numel // hidden if p.numel % hidden == 0 else p.numel


def shard_elements(params: list[Param], data: int, hidden: int) -> int:
    """Elements each rank stores of ``params``: ``ceil(rows / data)`` rows of each, the first chunk's size."""
    return sum(-(-_rows(p, hidden) // data) * (p.numel // _rows(p, hidden)) for p in params)


def _block(p: Param) -> str:
    """The transformer block ``p`` is in (its own FSDP2 group), or "" for the root's."""
    return p.name.split(".", 2)[1] if p.name.startswith("blocks.") else ""


def fsdp2_groups(params: list[Param]) -> tuple[list[Param], list[list[Param]]]:
    """(root, blocks): the parameters of each block, in order, and the root's, what is left."""
    blocks: dict[str, list[Param]] = {}
    for p in params:
        if _block(p):
            blocks.setdefault(_block(p), []).append(p)
    return [p for p in params if not _block(p)], list(blocks.values())


def _group(params: list[Param], data: int, width: int, hidden: int) -> _Group:
    shard = shard_elements(params, data, hidden)
    return _Group(width * data * shard, width * sum(p.numel for p in params), REDUCE_BYTES * data * shard)


def _forward_peak(root: _Group, blocks: list[_Group], reshard: bool) -> int:
    """At each block's all-gather: the root gathered, the blocks kept gathered (``reshard`` false), and two flat
    all-gather buffers, this block's and the previous group's (freed after this one's copy-out)."""
    peak, previous, kept = 2 * root.gathered, root.gathered, 0
    for block in blocks:
        peak = max(peak, root.gathered + kept + previous + block.gathered)
        kept += 0 if reshard else block.gathered
        previous = block.gathered
    return peak


def _backward_peak(root: _Group, head_grads: int, blocks: list[_Group], reshard: bool) -> int:
    """Block by block from the last: the root gathered with the head's gradients; this block and the one before
    (prefetched), or with ``reshard`` false every block not reduced yet; this block's gradients; and the later
    block's reduce-scatter input, kept until this block reduces (then this block's is made, its parameters
    freed). Last the root: its gradients with it gathered, then beside its own reduce-scatter input."""
    peak, later = 0, 0
    for i in reversed(range(len(blocks))):
        held = blocks[max(0, i - 1):i + 1] if reshard else blocks[:i + 1]
        base = root.gathered + head_grads + sum(b.gathered for b in held) + blocks[i].grads
        peak = max(peak, base + later, base - blocks[i].gathered + blocks[i].reduce)
        later = blocks[i].reduce
    return max(peak, root.gathered + root.grads + later, root.grads + root.reduce)


def _notes(root: list[Param], blocks: list[list[Param]], shard: int, numel: int, data: int, reshard: bool,
           offload: bool) -> list[str]:
    if blocks:
        notes = [f"FSDP2 keeps the root group (embeddings, final LayerNorm, head: {sum(p.numel for p in root):,} "
                 "elements) gathered from the start of the forward pass to the end of the backward pass"]
    else:
        notes = ["the login node does not know your model's FSDP2 blocks: planned as one group, gathered whole "
                 "(an upper bound)"]
    if not reshard and blocks:
        notes.append(f"fsdp.reshard_after_forward = false keeps all {len(blocks)} blocks gathered from their "
                     "forward to their backward")
    if shard * data > numel:
        notes.append(f"FSDP2 pads each tensor's dim 0 to a multiple of {data}: {shard:,} elements per rank for "
                     f"{numel:,} / {data}")
    if offload:
        notes.append("fsdp.offload: shards, gradients and AdamW state in CPU memory, stepped there; the GPU keeps "
                     "the gathered groups and the reduction buffers")
    return notes


def fsdp2_held(params: list[Param], *, data: int, width: int, hidden: int, offload: bool,
               reshard_after_forward: bool, tensor: int) -> Fsdp2Held:
    """What one rank of ``data`` holds of ``params`` (one tensor-parallel rank's, in module order), computing in
    ``width``-byte numbers (2: bf16, 4: fp32); ``hidden`` is the GPT's width (0: shapes unknown)."""
    root_params, block_params = fsdp2_groups(params)
    root = _group(root_params, data, width, hidden)
    blocks = [_group(b, data, width, hidden) for b in block_params]
    last = max((i for i, p in enumerate(params) if _block(p)), default=len(params))
    head_grads = width * sum(p.numel for p in params[last + 1:])
    kept = [b.gathered for b in blocks]
    gathered = root.gathered + (max(kept, default=0) if reshard_after_forward else sum(kept))
    reduce_buffers = max(_forward_peak(root, blocks, reshard_after_forward),
                         _backward_peak(root, head_grads, blocks, reshard_after_forward))
    # AdamW's foreach step takes one parameter group (matrices, the rest) at a time; with tensor > 1 one tensor
    decay, rest = [p for p in params if p.matrix], [p for p in params if not p.matrix]
    steps = [[p] for p in params] if tensor > 1 else [decay, rest]
    step_buffers = 4 * max(shard_elements(group, data, hidden) for group in steps)
    shard = shard_elements(params, data, hidden)
    notes = tuple(_notes(root_params, block_params, shard, sum(p.numel for p in params), data,
                         reshard_after_forward, offload))
    if offload:
        return Fsdp2Held(0, 0, 0, gathered, reduce_buffers, 0, 16 * shard, notes)
    return Fsdp2Held(4 * shard, 4 * shard, 8 * shard, gathered, reduce_buffers, step_buffers, 0, notes)
