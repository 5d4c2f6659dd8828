"""``retry.shrink``: the size a job goes on at inside its allocation when a node is lost and no spare is left,
and the plan its ranks run under then.

The tensor, pipeline and context sizes are kept (a checkpoint reshards on the data axis, not on those), and so
are the micro batch and the global batch: the data-parallel size shrinks and gradient accumulation grows by the
same factor, so every step still sees the same samples in the same order and the schedule is unchanged. The
largest node count that allows this wins (a node may stay idle when the count left does not divide). Pure
arithmetic: the agents (no torch) choose the size, and each rank of the smaller life rebuilds its plan here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_train.errors import ConfigError

if TYPE_CHECKING:
    from hpc_train.config.plan import Plan

__all__ = ["SHRUNK_NODES_ENV", "ShrunkSize", "plan_for_life", "shrunk_plan", "smaller_size"]

SHRUNK_NODES_ENV = "HPC_TRAIN_SHRUNK_NODES"  # set by the agent for a life on fewer nodes than the plan's


@dataclass(frozen=True)
class ShrunkSize:
    """A life on fewer nodes: its node count, ranks, data-parallel size and accumulation."""

    nodes: int
    world: int
    data: int
    grad_accum: int


def smaller_size(model_parallel: int, micro_batch: int, global_batch: int, tasks_per_node: int,
                 nodes_left: int) -> ShrunkSize | None:
    """The largest size on at most ``nodes_left`` nodes that keeps the model-parallel size (tensor x pipeline x
    context) and the global batch; None when no node count does."""
    for nodes in range(nodes_left, 0, -1):
        world = nodes * tasks_per_node
        if world % model_parallel:
            continue
        data = world // model_parallel
        if global_batch % (micro_batch * data):
            continue
        return ShrunkSize(nodes, world, data, global_batch // (micro_batch * data))
    return None


def shrunk_plan(plan: Plan, nodes: int) -> Plan:
    """``plan`` for a life on ``nodes`` nodes; a ValueError when that size cannot keep the layout."""
    layout, resources = plan.layout, plan.resources
    if nodes == resources.nodes:
        return plan
    size = smaller_size(layout.tensor * layout.pipeline * layout.context, layout.micro_batch, layout.global_batch,
                        resources.tasks_per_node, nodes)
    if size is None or size.nodes != nodes:
        raise ValueError(f"{nodes} node(s) cannot keep this job's layout (tensor {layout.tensor}, pipeline "
                         f"{layout.pipeline}, global batch {layout.global_batch})")
    config = plan.config
    train = dataclasses.replace(config.train, grad_accum=size.grad_accum)
    return dataclasses.replace(
        plan, resources=dataclasses.replace(resources, nodes=nodes),
        layout=dataclasses.replace(layout, world=size.world, data=size.data, grad_accum=size.grad_accum),
        config=dataclasses.replace(config, job=dataclasses.replace(config.job, nodes=nodes), train=train))


def plan_for_life(plan: Plan, env: Mapping[str, str]) -> Plan:
    """The plan this rank runs under: the run's, or the smaller one the agents chose for this life. A
    ConfigError (one line on the rank's stderr, exit 2) when the variable came from somewhere else."""
    value = env.get(SHRUNK_NODES_ENV, "")
    if not value:
        return plan
    fix = f"unset {SHRUNK_NODES_ENV} in the job's environment; hpc_train's agent sets it for a life on fewer nodes"
    if not value.isdigit() or not plan.config.retry.shrink:
        raise ConfigError(f"{SHRUNK_NODES_ENV}={value!r}", "is set, but only hpc_train's agent sets it, to a node "
                          "count, for a job with retry.shrink", fix)
    try:
        return shrunk_plan(plan, int(value))
    except ValueError as error:
        raise ConfigError(f"{SHRUNK_NODES_ENV}={value!r}", str(error), fix) from None
