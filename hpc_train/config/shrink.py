"""``retry.shrink``: the size a job goes on at inside its allocation when a node is lost and no spare is left.

The tensor, pipeline and context sizes are kept (a checkpoint reshards on the data axis, not on those), and so
are the micro batch and the global batch: the data-parallel size shrinks and gradient accumulation grows by the
same factor, so every step still sees the same samples in the same order and the schedule is unchanged. The
largest node count that allows this wins (a node may stay idle when the count left does not divide). Pure
arithmetic, defined once: the check at submit, the agents (no torch) that choose the size and each rank's plan
of the smaller life (``hpc_train.config.plan.plan_for_life``) all ask a :class:`ShrinkRule`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SHRUNK_NODES_ENV", "ShrinkRule", "ShrunkSize"]

SHRUNK_NODES_ENV = "HPC_TRAIN_SHRUNK_NODES"  # set by the agent for a life on fewer nodes than the plan's


@dataclass(frozen=True)
class ShrunkSize:
    """A life on fewer nodes: its node count, ranks, data-parallel size and accumulation."""

    nodes: int
    world: int
    data: int
    grad_accum: int


@dataclass(frozen=True)
class ShrinkRule:
    """What a smaller life keeps: the model-parallel size (tensor x pipeline x context), the micro and global
    batch, and the ranks a node holds."""

    model_parallel: int
    micro_batch: int
    global_batch: int
    tasks_per_node: int

    def size(self, nodes_left: int) -> ShrunkSize | None:
        """The largest size on at most ``nodes_left`` nodes that keeps the rule; None when no node count does."""
        for nodes in range(nodes_left, 0, -1):
            world = nodes * self.tasks_per_node
            if world % self.model_parallel:
                continue
            data = world // self.model_parallel
            if self.global_batch % (self.micro_batch * data):
                continue
            return ShrunkSize(nodes, world, data, self.global_batch // (self.micro_batch * data))
        return None
