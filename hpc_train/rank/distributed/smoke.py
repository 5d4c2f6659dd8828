"""The distributed smoke program: every rank joins the job, builds the parallel groups of the plan's layout,
and proves them with all-reduces: over the world (the sum of all ranks) and over each axis (the sum of the
ranks the topology says belong to the group).

It checks the whole path (plan, launcher, rendezvous, process group, groups) before any model is involved,
and it is what a submitted job runs until the trainer exists.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from hpc_train.common.topology import AXES, Topology
from hpc_train.config.plan import Plan
from hpc_train.rank.distributed.faults import maybe_inject_fault
from hpc_train.rank.distributed.launchers import LaunchInfo

__all__ = ["run_smoke"]


def _check_groups(topology: Topology, rank: int) -> dict[str, list[int]]:
    from hpc_train.rank.distributed.collectives import all_reduce_values, group_device
    from hpc_train.rank.distributed.mesh import ParallelGroups

    groups = ParallelGroups(topology, group_device().type)
    seen = {}
    for axis in AXES:
        ranks = groups.ranks(axis)
        expected = topology.group_of(rank, axis)
        if ranks != expected:
            raise RuntimeError(f"the {axis} group of rank {rank} holds {ranks}, the topology says {expected}")
        total = all_reduce_values([float(rank)], group=groups.group(axis))[0]
        if total != sum(expected):
            raise RuntimeError(f"all-reduce over the {axis} group {expected} gave {total}")
        seen[axis] = ranks
    return seen


def run_smoke(plan: Plan, info: LaunchInfo) -> dict[str, Any]:
    """Bootstrap, all-reduce the ranks, check every group; raise on any mismatch."""
    from hpc_train.rank.distributed.bootstrap import bootstrap, shutdown
    from hpc_train.rank.distributed.collectives import all_gather_objects, all_reduce_values

    dist_config = plan.config.dist
    context = bootstrap(info, port_range=(plan.port_range[0], plan.port_range[1]), fabric_suffix=plan.fabric_suffix,
                        init_timeout_s=dist_config.init_timeout_s,
                        timeout_s=dist_config.timeout_s)
    # No try/finally: on an error the process group is left to process exit, so that the failing rank reports
    # before its peers notice it is gone (the follower names the first rank to fail as the cause).
    maybe_inject_fault(info.rank)
    value = all_reduce_values([float(info.rank)])[0]
    expected = info.world_size * (info.world_size - 1) / 2
    if value != expected:
        raise RuntimeError(f"all_reduce of ranks gave {value}, expected {expected}")
    # Slurm's node name tells nodes apart even where several share one host (the local test cluster).
    hosts = all_gather_objects(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    layout = plan.layout
    topology = Topology.build(info.world_size, tp=layout.tensor, pp=layout.pipeline, cp=layout.context,
                              order=layout.order)
    groups = _check_groups(topology, info.rank)  # on every backend: the numbers go to the group's device
    shutdown()
    return {"rank": info.rank, "world_size": info.world_size, "backend": context.backend,
            "all_reduce": value, "expected": expected, "hosts": hosts, "launcher": info.launcher,
            "node_rank": info.node_rank, "num_nodes": info.num_nodes, "groups": groups,
            "rendezvous": f"{context.rendezvous.addr}:{context.rendezvous.port}"}
