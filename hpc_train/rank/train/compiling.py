"""``train.compile``: each block of the model compiled on its own with ``torch.compile``, the recipe of
torchtitan (``apply_compile``) and of PyTorch's FSDP2 notes.

Why per block: the blocks of a transformer have one shape, so dynamo traces one and reuses the graph for every
block (``inline_inbuilt_nn_modules``: parameters are inputs, not constants), the compile time does not grow with
depth, and an engine's hooks on a block's boundary stay outside the graph (FSDP2's all-gather and reduce-scatter
hooks are skipped by dynamo and run eagerly). ``Module.compile`` compiles in place, so the parameters' names,
and with them checkpoints, exports and ``strict`` loads, are those of the eager model: a run can be resumed
compiled from an eager checkpoint and the other way round. ``Module.compile`` is lazy: called before the engine
wraps the model, it traces at the first step what the engine made of each block (tensor parallelism's DTensors,
FSDP2's shards), which is the order torchtitan's ``parallelize`` applies them in."""

from __future__ import annotations

from torch import nn

from hpc_train.rank.train.engine_fsdp2 import fsdp_blocks

__all__ = ["compile_blocks", "compile_report"]


def compile_blocks(model: nn.Module, backend: str) -> int:
    """Compile each of ``model``'s blocks in place with ``backend``; returns how many. A model with no blocks of
    its own is compiled whole."""
    blocks = fsdp_blocks(model) or [model]
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def compile_report(first_step_s: float) -> str:
    """What the first step compiled, for the log: dynamo's graphs and graph breaks (each break is a return to
    eager Python inside a block, the usual cause of a compiled run that is no faster), and the first break's
    reason in a line."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"].get("unique_graphs", 0)
    breaks = sum(counters["graph_break"].values())
    line = (f"compile: the first step took {first_step_s:.1f} s; dynamo made {graphs} graph(s) with {breaks} "
            "graph break(s)")
    if breaks:
        reason = next(iter(counters["graph_break"])).splitlines()[0]
        line += f" (first: {reason}; TORCH_LOGS=graph_breaks says where)"
    return line
