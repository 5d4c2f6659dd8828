"""Who a node's agent is (:mod:`hpc_train.rank.agent`): its place in the step and the run's plan, read from Slurm's
variables and ``plan.json``; None where no agent belongs (the rank then runs alone and says what is wrong)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_train.backends import backend_of
from hpc_train.checkpoint.memory_store import why_memory_tier_off
from hpc_train.config.shrink import ShrinkRule
from hpc_train.rank.agent.rejoin import trains_warm
from hpc_train.run.assignment import node_of
from hpc_train.run.in_place import IN_PLACE_LEFT_ENV

if TYPE_CHECKING:
    from hpc_train.config.job import RetrySection

__all__ = ["AgentSetup", "Spares", "agent_setup"]


@dataclass(frozen=True)
class AgentSetup:
    """Who this agent is: the run, its node's place in the step, the Slurm attempt and how many restarts it may
    make."""

    run_dir: Path
    node: int  # this agent's index among the step's nodes (its task); with spares, its slot in the allocation
    nodes: tuple[str, ...]  # the step's nodes in Slurm's order (one agent each)
    world_size: int
    job_id: str
    restart: int
    limit: int
    preempt_signal: str  # the plan's signal (USR2 by default): the rank saves on it, the agent stops restarting
    tasks_per_node: int = 1  # the ranks this agent starts (job.tasks_per_node)
    spares: Spares | None = None  # spares or retry.shrink: the layout this node's agent must keep
    cpus_per_rank: int = 0  # job.cpus_per_task, each rank's SLURM_CPUS_PER_TASK; 0: left as the step has it
    standby: str = ""  # retry.standby: the kind of standby rank to keep ready (standby_main.KINDS); "": none
    memory: bool = False  # checkpoint.memory_every_steps: this agent holds its ranks' states in memory
    warm: bool = False  # the ranks may train a later life in their own process (rejoin.trains_warm)

    @property
    def node_name(self) -> str:
        return self.nodes[self.node]

    @property
    def member(self) -> str:
        """This agent's name on the coordinator: its node is in it, so a gone agent names a lost node."""
        return f"node-{self.node}@{self.node_name}"


@dataclass(frozen=True)
class Spares:
    """The layout a job keeps when it goes on without a lost node (hot spares, or ``retry.shrink``)."""

    nodes: int  # the layout's (job.nodes)
    shrink: ShrinkRule | None = None  # retry.shrink: what a smaller life keeps (Plan.shrink_rule)

    def smaller(self, nodes_left: int) -> int | None:
        """The node count a life goes on with when only ``nodes_left`` are left (retry.shrink); None without it."""
        size = self.shrink.size(nodes_left) if self.shrink else None
        return size.nodes if size else None


def agent_setup(run_dir: Path, env: dict[str, str] | None = None) -> AgentSetup | None:
    """The agent's setup when this process is the srun task of a node whose ranks restart in place; None otherwise
    (the local executor, torchrun or mpirun, ``retry.in_place = 0``, or a step or run folder that the rank itself
    must refuse: it then runs alone in this process and says what is wrong)."""
    env = dict(os.environ) if env is None else env
    if IN_PLACE_LEFT_ENV in env or not backend_of(env).on_slurm or "SLURM_STEP_ID" not in env:
        return None
    try:
        from hpc_train.common.hostlist import expand
        from hpc_train.config.plan import Plan
        from hpc_train.run.folder import check_run_folder
        from hpc_train.run.paths import PLAN_FILE

        check_run_folder(run_dir)
        plan = Plan.from_json((run_dir / PLAN_FILE).read_text(encoding="utf-8"))
        res, lay = plan.resources, plan.layout
        nodes = tuple(expand(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]))
        tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        if not plan.node_agents or tasks != len(nodes) or tasks != res.nodes + res.spare_nodes:
            return None
        name = node_of(env)
        index = nodes.index(name) if name in nodes else int(env["SLURM_NODEID"])
        spares = None
        if plan.survives_lost_node:
            spares = Spares(res.nodes, plan.shrink_rule)
    except Exception:  # the rank reports whatever is wrong, in its own words
        return None
    if lay.world != res.nodes * res.tasks_per_node:
        return None
    return AgentSetup(run_dir, index, nodes, lay.world, env["SLURM_JOB_ID"], int(env.get("SLURM_RESTART_COUNT") or 0),
                      plan.config.retry.in_place, plan.signal, res.tasks_per_node, spares, res.cpus_per_task,
                      _standby(plan.config.job.program, plan.config.retry),
                      not why_memory_tier_off(plan.config, lay.tensor, lay.pipeline), trains_warm(plan))


def _standby(program: str, retry: RetrySection) -> str:
    """The standby ranks' kind (``retry.standby``): the trainer's or a user program's; none for the smoke test
    (nothing to import) or without restarts in place."""
    if not retry.standby or retry.in_place < 1 or program == "smoke":
        return ""
    return "train" if program == "train" else "program"
