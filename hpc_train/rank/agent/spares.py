"""The agent's lives in a job with hot spares (``[job] spare_nodes``): who holds the ranks, and who takes over a lost
node's, inside the same Slurm job.

Every allocated node runs one agent (the srun step covers the spares too). In each life the assignment
(:mod:`hpc_train.run.assignment`) says which nodes hold the ranks; an agent on a node outside it waits as a spare
for the next restart notice, or for the ranks to leave for good. At a restart every live agent ends its node's ranks
and says it is ready (one arrival per node). Once all have (or, without a coordinator, once ``_LOST_AFTER_S`` has
passed), the first agent to decide writes the next assignment: a node whose agent did not answer is lost (its ranks
go to a spare, and it joins the run's ``excluded_nodes.json``). With too few nodes left the agents leave, and the
retry policy requeues the job as without spares.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from hpc_train.config.shrink import SHRUNK_NODES_ENV
from hpc_train.control.client import ControlError
from hpc_train.rank.agent.link import AgentLink
from hpc_train.rank.agent.memory import NodeMemory, memory_environment
from hpc_train.rank.agent.setup import AgentSetup
from hpc_train.rank.agent.standby import StandbyPool
from hpc_train.run.assignment import (
    Assignment,
    assignment_from,
    first_assignment,
    mark_left,
    mark_task_ready,
    next_assignment,
    publish_assignment,
    rank_environments,
    ranks_left,
    read_assignment,
    ready_nodes,
)
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.exclusions import add_exclusions, read_exclusions
from hpc_train.run.in_place import IN_PLACE_ENV, IN_PLACE_LEFT_ENV, RestartNotice, ready_key

__all__ = ["run_with_spares"]

_POLL_S = 0.2
_LOST_AFTER_S = 15.0  # without a coordinator: an agent that has not said it is ready by then is on a lost node
_MEET_S = 120.0  # with one: a node is lost when its agent's connection drops; an agent alive but silent this long
# (stuck ending its ranks) leaves the job to Slurm


class NodeAgent(Protocol):
    """What the spares' lives need of a node's agent (:class:`hpc_train.rank.agent.agent.Agent`): its place, its link to
    the coordinator, its loggers, and one life of its ranks."""

    setup: AgentSetup
    attempt: str
    rank: int
    log: logging.Logger
    link: AgentLink | None
    holding_nodes: set[str] | None
    stopping: int | None
    standby: StandbyPool | None
    memory: NodeMemory | None

    def keep_standbys(self, argv: list[str]) -> None: ...

    def logger_for(self, rank: int) -> logging.Logger: ...

    def rank_environments(self, places: dict[int, dict[str, str]], extra: dict[str, str]
                          ) -> dict[int, dict[str, str]]: ...

    def run_once(self, argv: list[str], envs: dict[int, dict[str, str]], in_place: int
                 ) -> tuple[int, RestartNotice | None]: ...

    def notice(self, in_place: int) -> RestartNotice | None: ...

    def record(self, notice: RestartNotice) -> None: ...

    def end_everything_below(self) -> None: ...


def run_with_spares(agent: NodeAgent, argv: list[str]) -> int:
    """Every life of this node: its ranks where the assignment puts
    some, a wait where it does not."""
    setup, spares = agent.setup, agent.setup.spares
    if spares is None:
        raise RuntimeError("run_with_spares needs an agent of a job with spare nodes")
    excluded = [entry.node for entry in read_exclusions(setup.run_dir)]
    allocated, per_node = setup.nodes, setup.tasks_per_node
    assignment, in_place = first_assignment(allocated, spares.nodes, excluded), 0
    agent.keep_standbys(argv)
    agent.link = AgentLink.open(setup.run_dir, agent.attempt, setup.job_id, setup.member, agent.log,
                                host=setup.node == 0)
    agent.memory = NodeMemory.open(setup, agent.link, agent.attempt, agent.log)
    coordinator = {**(agent.link.environment() if agent.link else {}), **memory_environment(agent.memory)}
    while True:
        places = rank_environments(assignment, setup.node_name, per_node)
        if not places:
            agent.rank = -1
            if agent.standby is not None:  # a spare node: nothing of its own to start, its standbys start now
                agent.standby.refill()
            code, notice = 0, _wait_as_spare(agent, in_place)
        else:
            agent.rank = min(places)
            agent.log = agent.logger_for(agent.rank)
            agent.holding_nodes = set(assignment.nodes)  # a lost spare does not restart the ranks
            extra = {**coordinator, IN_PLACE_ENV: str(in_place), IN_PLACE_LEFT_ENV: str(setup.limit - in_place)}
            if len(assignment.nodes) < spares.nodes:  # retry.shrink: the ranks plan for the nodes left
                extra[SHRUNK_NODES_ENV] = str(len(assignment.nodes))
            code, notice = agent.run_once(argv, agent.rank_environments(places, extra), in_place)
        agent.end_everything_below()
        if notice is None:
            if places:
                _say_left(agent)  # the spares leave with the ranks
            return code
        decided, won = _next_life(agent, notice, assignment)
        if decided is None or not decided.nodes:
            agent.log.error("in-place restart %d: too few healthy nodes for the layout (%d needed, lost: %s); "
                            "leaving the job to Slurm and the retry policy", notice.in_place, spares.nodes,
                            ", ".join(decided.lost) if decided else "?")
            _say_left(agent)
            return 1 if places else 0
        if won:
            agent.record(notice)
        if agent.stopping is not None:  # Slurm's signal came while the ranks were down: none would hear it
            agent.log.error("in-place restart %d: Slurm's signal came while the ranks were down; not starting them "
                            "again: leaving the job to Slurm and the retry policy", notice.in_place)
            _say_left(agent)
            return 1 if places else 0
        if decided.nodes[0] == setup.node_name:  # said once, in rank 0's log, which submit follows
            moved = [node for node in decided.nodes if node not in assignment.nodes]
            agent.logger_for(0).info(
                "in-place restart %d of %d (retry.in_place): %s: %s (rank %d on %s); ranks on %s%s, in job %s",
                notice.in_place, setup.limit, notice.failure_class, notice.reason, notice.rank, notice.host or "?",
                ",".join(decided.nodes), _change(setup, assignment, decided, moved), setup.job_id)
        assignment, in_place = decided, notice.in_place


def _change(setup: AgentSetup, before: Assignment, after: Assignment, moved: list[str]) -> str:
    """What the next life changes, for rank 0's log: a spare in a lost node's place, or a smaller size."""
    if moved:
        return f" (spare {', '.join(moved)} for lost {', '.join(after.lost)})"
    rule = setup.spares.shrink if setup.spares else None
    if len(after.nodes) < len(before.nodes) and rule is not None:
        was, now = rule.size(len(before.nodes)), rule.size(len(after.nodes))
        if was is not None and now is not None:
            return (f" (retry.shrink: {was.nodes} -> {now.nodes} nodes without lost {', '.join(after.lost)}; data "
                    f"parallel {was.data} -> {now.data}, grad_accum {was.grad_accum} -> {now.grad_accum}, global "
                    "batch kept)")
    return ""


def _wait_as_spare(agent: NodeAgent, in_place: int) -> RestartNotice | None:
    """A spare waits for the next restart notice; None once the ranks have left for good, or Slurm stops it."""
    setup = agent.setup
    while agent.stopping is None and not _ranks_left(agent):
        if in_place < setup.limit:
            notice = agent.notice(in_place + 1)
            if notice is not None:
                return notice
        time.sleep(_POLL_S)
    return None


def _next_life(agent: NodeAgent, notice: RestartNotice, previous: Assignment) -> tuple[Assignment | None, bool]:
    """Say this node is ready, then read or make the next assignment: (it, whether this agent made it)."""
    setup = agent.setup
    life, agents, smaller = notice.in_place, len(setup.nodes), _smaller(setup)
    if agent.link is not None and agent.link.usable:
        with contextlib.suppress(ControlError):
            return _next_life_over_link(agent, life, agents, previous)
    mark_task_ready(setup.run_dir, agent.attempt, life, setup.node, setup.node_name)
    deadline = time.monotonic() + _LOST_AFTER_S
    while agent.stopping is None:
        decided = read_assignment(setup.run_dir, agent.attempt, life)
        if decided is not None:
            return decided, False
        ready = ready_nodes(setup.run_dir, agent.attempt, life, agents)
        if sum(ready.values()) >= agents or time.monotonic() > deadline:
            healthy = [node for node in setup.nodes if ready[node] >= 1]
            lost = [node for node in previous.nodes if node not in healthy]
            made = next_assignment(previous, healthy, setup.nodes, life, smaller) or Assignment(life, [], lost)
            decided, won = publish_assignment(setup.run_dir, agent.attempt, made)
            if won and lost:
                add_exclusions(setup.run_dir, lost, "node_failure", setup.job_id,
                               f"its agent did not answer in-place restart {life} within {_LOST_AFTER_S:.0f} s")
            return decided, won
        time.sleep(0.1)
    return None, False


def _smaller(setup: AgentSetup) -> Callable[[int], int | None]:
    """retry.shrink's node count for the nodes left (None without it)."""
    spares = setup.spares
    return lambda left: spares.smaller(left) if spares else None


def _ranks_left(agent: NodeAgent) -> bool:
    if agent.link is not None and agent.link.usable:
        return bool(agent.link.ranks_left())
    return ranks_left(agent.setup.run_dir, agent.attempt)


def _say_left(agent: NodeAgent) -> None:
    mark_left(agent.setup.run_dir, agent.attempt)  # the record, and the word for agents without a coordinator
    if agent.link is not None and agent.link.usable:
        agent.link.say_left()


def _next_life_over_link(agent: NodeAgent, life: int, agents: int, previous: Assignment
                         ) -> tuple[Assignment | None, bool]:
    """The barrier over the coordinator: decided once every node's agent said ready or is gone (its connection
    dropped: its node is lost), one message each way per node; the first agent's assignment holds."""
    setup, link = agent.setup, agent.link
    decided = link.meet(ready_key(agent.attempt, life), setup.member, agents, _MEET_S,
                        lambda: agent.stopping is not None)
    if decided is None:
        agent.log.error("in-place restart %d: not every agent answered within %.0f s, and none is known lost",
                        life, _MEET_S)
        return None, False
    if decided.get("gone_count", 0) > len(decided.get("gone", [])):
        agent.log.error("in-place restart %d: %s agents gone, more than the barrier names", life, decided["gone_count"])
        return None, False
    gone = {str(name).partition("@")[2] for name in decided.get("gone", [])}
    healthy = [node for node in setup.nodes if node not in gone]
    lost = [node for node in previous.nodes if node not in healthy]
    made = next_assignment(previous, healthy, setup.nodes, life, _smaller(setup)) or Assignment(life, [], lost)
    held = link.propose(life, {**asdict(made), "by": setup.member})
    won = isinstance(held, dict) and held.get("by") == setup.member
    assignment = assignment_from(held, life) or made
    if won:
        publish_assignment(setup.run_dir, agent.attempt, assignment)  # the record
        if lost:
            add_exclusions(setup.run_dir, lost, "node_failure", setup.job_id,
                           f"its agent left the job's coordinator at in-place restart {life}")
    return assignment, won


def settle(run_dir: Path, code: int, job_id: str) -> int:
    """The batch script's status after a step with hot spares: 0 when this job's newest attempt completed (a
    lost node's task made srun's status non-zero though a spare took its ranks), else srun's ``code``."""
    attempts = [a for a in AttemptLog(run_dir).read() if a.job_id == job_id]
    return 0 if attempts and attempts[-1].outcome == "completed" else code
