"""What a rank knows about its place in the job: the part of the run context that needs no training loop.

A model factory and a dataset (``[train] model``, ``[data] source``) get a :class:`RankContext`: the trainer
owns the loop, so they need the groups, the device, the config and ``params``, not ``should_stop()``. A user
program's :class:`~hpc_train.rank.program.context.RunContext` is the same with the loop's parts added, so code
written against one reads the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train.common.topology import AXES
from hpc_train.config.job import JobConfig
from hpc_train.config.plan import Plan
from hpc_train.rank.distributed.launchers import LaunchInfo
from hpc_train.rank.distributed.mesh import ParallelGroups

__all__ = ["RankContext"]


class RankContext:
    """This rank's place (rank, world, local rank, node, restart), device, run folder, ``[params]``,
    ``job.args``, the whole typed ``config`` and the process groups of ``[parallel]``."""

    def __init__(self, plan: Plan, info: LaunchInfo, run_dir: Path, groups: ParallelGroups, device: Any) -> None:
        self.rank, self.world_size = info.rank, info.world_size
        self.local_rank, self.local_world_size = info.local_rank, info.local_world_size
        self.node_rank, self.restart = info.node_rank, info.restart
        self.run_dir = run_dir
        self.config: JobConfig = plan.config
        self.params: dict[str, Any] = dict(plan.config.params)
        self.args: list[str] = list(plan.config.job.args)
        self.device = device
        self._groups = groups

    def group(self, name: str) -> Any:
        """The process group of this rank along ``name``: one of dp, tp, pp, cp (sizes from ``[parallel]``)."""
        if name not in AXES:
            raise ValueError(f'no group "{name}"; valid: {", ".join(AXES)}')
        return self._groups.group(name)

    @property
    def mesh(self) -> Any:
        """The job's DeviceMesh, its dimensions named after the axes (``ctx.mesh["dp"]``)."""
        return self._groups.mesh
