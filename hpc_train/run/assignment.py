"""Which nodes hold the ranks when a job has hot spares (``[job] spare_nodes``): the assignment of each life of
an attempt, and the rank's place in it.

srun starts one agent on every allocated node, spares included. The first ``job.nodes`` healthy nodes of the
allocation hold the ranks, in Slurm's order; the others wait. When a restart inside the job is due, every agent
still alive says so (its ready mark), and the first agent to decide writes the next assignment (O_EXCL, so one
decision wins). It keeps every healthy node where it was, puts a spare where a node was lost, and keeps the
layout (tensor, pipeline, data) because the node count does not change. A rank started under an assignment sees
the job as the plan drew it: its ``SLURM_*`` place is rewritten to the assigned nodes, so the geometry check,
the rendezvous (the first assigned node) and the launcher detection need nothing else.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpc_train.common.hostlist import compress
from hpc_train.run.files import read_json_object, read_record_text
from hpc_train.run.paths import HEARTBEAT_DIR

__all__ = [
    "Assignment",
    "assignment_from",
    "assignment_key",
    "assignment_path",
    "first_assignment",
    "left_key",
    "mark_left",
    "mark_task_ready",
    "next_assignment",
    "node_of",
    "publish_assignment",
    "rank_environment",
    "rank_environments",
    "ranks_left",
    "read_assignment",
    "ready_nodes",
]


@dataclass(frozen=True)
class Assignment:
    """The nodes that hold the ranks in one life (node index = position), and the nodes found lost for it."""

    in_place: int
    nodes: list[str]
    lost: list[str] = field(default_factory=list)

    def spares(self, allocated: Sequence[str]) -> list[str]:
        return [node for node in allocated if node not in self.nodes and node not in self.lost]


def first_assignment(allocated: Sequence[str], nodes: int, excluded: Iterable[str] = ()) -> Assignment:
    """Life 0: the first ``nodes`` of the allocation that the run does not exclude (then any, if too few)."""
    avoid = set(excluded)
    preferred = [node for node in allocated if node not in avoid]
    chosen = preferred[:nodes] if len(preferred) >= nodes else list(allocated[:nodes])
    return Assignment(0, chosen)


def next_assignment(previous: Assignment, healthy: Iterable[str], allocated: Sequence[str], in_place: int,
                    smaller: Callable[[int], int | None] | None = None) -> Assignment | None:
    """The next life's nodes: every healthy node keeps its place, a lost one is replaced by a healthy spare. With
    no spare left, ``smaller`` (``retry.shrink``) says how many of the nodes left go on (the first ones, in their
    order). None when there are not enough healthy nodes (the retry policy requeues instead)."""
    ok = set(healthy)
    spares = [node for node in previous.spares(allocated) if node in ok]
    nodes, lost = [], list(previous.lost)
    for node in previous.nodes:
        if node in ok:
            nodes.append(node)
            continue
        lost.append(node)
        if spares:
            nodes.append(spares.pop(0))
    if len(nodes) == len(previous.nodes):
        return Assignment(in_place, nodes, lost)
    count = smaller(len(nodes)) if smaller is not None and nodes else None
    return Assignment(in_place, nodes[:count], lost) if count else None


def assignment_key(attempt: str, in_place: int) -> str:
    """The coordinator's key of life ``in_place``'s assignment (:mod:`hpc_train.control`)."""
    return f"{attempt}/assign/{in_place}"


def left_key(attempt: str) -> str:
    """The coordinator's key that says the ranks of ``attempt`` left for good."""
    return f"{attempt}/left"


def assignment_path(run_dir: Path, attempt: str, in_place: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"assign-{attempt}.{in_place}.json"


def publish_assignment(run_dir: Path, attempt: str, assignment: Assignment) -> tuple[Assignment, bool]:
    """Write ``assignment`` unless another agent decided first: (the one that stands, whether it is this one)."""
    path = assignment_path(run_dir, attempt, assignment.in_place)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(descriptor, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(asdict(assignment)))
    won = True
    try:
        os.link(tmp, path)  # atomic and exclusive: the first decision wins, complete
    except FileExistsError:
        won = False
    finally:
        tmp.unlink()
    found = read_assignment(run_dir, attempt, assignment.in_place)
    return (found if found is not None else assignment), won


def read_assignment(run_dir: Path, attempt: str, in_place: int) -> Assignment | None:
    return assignment_from(read_json_object(assignment_path(run_dir, attempt, in_place)), in_place)


def assignment_from(data: object, in_place: int) -> Assignment | None:
    """An assignment as a file or the coordinator carries it (a JSON object), or None when it is not one."""
    if not isinstance(data, dict):
        return None
    nodes, lost = data.get("nodes"), data.get("lost", [])
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in [*nodes, *lost]):
        return None
    return Assignment(int(data.get("in_place", in_place)), nodes, lost)


def rank_environment(assignment: Assignment, node: str, local: int, tasks_per_node: int) -> dict[str, str] | None:
    """The ``SLURM_*`` place of the rank this node's task ``local`` runs under ``assignment``; None on a spare."""
    if node not in assignment.nodes:
        return None
    index, count = assignment.nodes.index(node), len(assignment.nodes)
    world, listed, spec = count * tasks_per_node, compress(assignment.nodes), f"{tasks_per_node}(x{count})"
    return {"SLURM_PROCID": str(index * tasks_per_node + local), "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(index), "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
            "SLURM_NTASKS": str(world), "SLURM_NPROCS": str(world), "SLURM_STEP_NUM_TASKS": str(world),
            "SLURM_NNODES": str(count), "SLURM_JOB_NUM_NODES": str(count), "SLURM_STEP_NUM_NODES": str(count),
            "SLURM_STEP_NODELIST": listed, "SLURM_JOB_NODELIST": listed, "SLURM_NODELIST": listed,
            "SLURM_STEP_TASKS_PER_NODE": spec, "SLURM_TASKS_PER_NODE": spec}


def rank_environments(assignment: Assignment, node: str, tasks_per_node: int) -> dict[int, dict[str, str]]:
    """Every rank ``node``'s agent starts under ``assignment``, with its ``SLURM_*`` place; empty on a spare."""
    places = (rank_environment(assignment, node, local, tasks_per_node) for local in range(tasks_per_node))
    return {int(place["SLURM_PROCID"]): place for place in places if place is not None}


def node_of(env: Mapping[str, str]) -> str:
    """This task's Slurm node name."""
    return env.get("SLURMD_NODENAME") or os.uname().nodename


def _task_mark(run_dir: Path, attempt: str, in_place: int, task: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"restart-{attempt}.{in_place}.task-{task}"


def mark_task_ready(run_dir: Path, attempt: str, in_place: int, task: int, node: str) -> None:
    """Task ``task``'s agent on ``node`` has ended its rank (or has none) and can start one in the next life."""
    path = _task_mark(run_dir, attempt, in_place, task)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(descriptor, "w", encoding="utf-8") as handle:
        handle.write(node)


def ready_nodes(run_dir: Path, attempt: str, in_place: int, tasks: int) -> Counter[str]:
    """How many tasks of each node are ready for life ``in_place``."""
    counts: Counter[str] = Counter()
    for task in range(tasks):
        node = read_record_text(_task_mark(run_dir, attempt, in_place, task)).strip()  # never through a link
        if node:
            counts[node] += 1
    return counts


def _left_mark(run_dir: Path, attempt: str) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"left-{attempt}"


def mark_left(run_dir: Path, attempt: str) -> None:
    """The ranks of ``attempt`` have ended for good (finished, or failed past any restart): spares leave too."""
    path = _left_mark(run_dir, attempt)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def ranks_left(run_dir: Path, attempt: str) -> bool:
    return _left_mark(run_dir, attempt).exists()
