"""Which launcher started this process, and this rank's place in the job, from that launcher's variables.

One function, one answer: :func:`detect_launch` reads torchrun, the DeepSpeed launcher, Open MPI, MPICH/PMI,
srun (and submitit on Slurm), submitit's local executor, or nothing (a single process). Missing or
contradictory variables raise :class:`LaunchError` before any process group exists, so a wrong launch line
fails in a second with a message instead of hanging in a rendezvous.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpc_train.run.in_place import in_place_index

__all__ = ["LAUNCHERS", "Geometry", "LaunchError", "LaunchInfo", "Launcher", "check_geometry", "detect_launch",
           "tasks_on_node"]


class LaunchError(RuntimeError):
    """The launcher's variables are missing or do not add up."""


@dataclass(frozen=True)
class Launcher:
    """What hpc_train must know of the launcher that started a rank, one per launcher: the rest of the rank side
    asks these, never the launcher's name."""

    name: str
    allocated: bool = False  # node count and ranks per node come from a scheduler's allocation: checked vs the plan
    srun: bool = False  # Slurm's own tasks: the step's node list is checked too
    sets_rendezvous: bool = False  # it exports MASTER_ADDR and MASTER_PORT itself
    mpi: bool = False  # the mpirun template exports the rendezvous; without it, mpi4py broadcasts rank 0's
    this_machine: bool = False  # every rank on this machine: the rendezvous is 127.0.0.1
    agent_store: bool = False  # torchrun's agent may host the store (TORCHELASTIC_USE_AGENT_STORE)
    own_process: bool = True  # False: someone's own Python called the rank's entry (no launcher at all)


LAUNCHERS = {launcher.name: launcher for launcher in (
    Launcher("srun", allocated=True, srun=True),
    Launcher("torchrun", allocated=True, sets_rendezvous=True, agent_store=True),
    Launcher("deepspeed", allocated=True, sets_rendezvous=True),
    Launcher("openmpi", allocated=True, mpi=True),
    Launcher("mpich", allocated=True, mpi=True),
    Launcher("submitit-local", this_machine=True),
    Launcher("env", sets_rendezvous=True),  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by hand
    Launcher("single", this_machine=True, own_process=False),
)}


@dataclass(frozen=True)
class LaunchInfo:
    """One rank's place in the job; ``master_addr``/``master_port`` are empty when the launcher sets none."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    nodelist: str
    job_id: str
    array_task: str
    restart: int
    master_addr: str = ""
    master_port: int = 0
    in_place: int = 0  # the in-place restart of this Slurm attempt (hpc_train.rank.agent.agent); 0 before any

    @property
    def kind(self) -> Launcher:
        """What the launcher that started this rank implies (a name of no launcher known here: nothing)."""
        return LAUNCHERS.get(self.launcher) or Launcher(self.launcher)


def _int(env: Mapping[str, str], *names: str) -> int:
    """The first of ``names`` that is set, as an int; LaunchError naming them when none is or it is not a number."""
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise LaunchError(f"{name}={env[name]!r} is not a number") from None
    raise LaunchError(f"{' or '.join(names)} is not set; the launcher did not say "
                      f"{'this' if len(names) == 1 else 'the'} rank's place")


def tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node ``node`` from Slurm's compressed ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``)."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
        if not match:
            raise LaunchError(f"cannot read the tasks per node {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    if not 0 <= node < len(counts):
        raise LaunchError(f"node {node} is not in the tasks per node {spec!r}")
    return counts[node]


def _slurm_ids(env: Mapping[str, str]) -> dict[str, object]:
    return {"job_id": env.get("SLURM_JOB_ID", ""), "array_task": env.get("SLURM_ARRAY_TASK_ID", ""),
            "restart": int(env.get("SLURM_RESTART_COUNT", "0") or 0), "in_place": in_place_index(env),
            "nodelist": env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")}


def _torchrun(env: Mapping[str, str]) -> LaunchInfo:
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    return LaunchInfo("torchrun", _int(env, "RANK"), _int(env, "LOCAL_RANK"), world, local,
                      _int(env, "GROUP_RANK"), max(1, world // local), **_slurm_ids(env),  # type: ignore[arg-type]
                      master_addr=env.get("MASTER_ADDR", ""), master_port=_int(env, "MASTER_PORT"))


def _deepspeed(env: Mapping[str, str]) -> LaunchInfo:
    return LaunchInfo("deepspeed", _int(env, "RANK"), _int(env, "LOCAL_RANK"), _int(env, "WORLD_SIZE"),
                      _int(env, "LOCAL_SIZE"), _int(env, "CROSS_RANK"), _int(env, "CROSS_SIZE"),
                      **_slurm_ids(env),  # type: ignore[arg-type]
                      master_addr=env.get("MASTER_ADDR", ""), master_port=_int(env, "MASTER_PORT"))


def _mpi(env: Mapping[str, str], kind: str) -> LaunchInfo:
    if kind == "openmpi":
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local, local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local, local_size = _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS")
    port = int(env.get("MASTER_PORT", "0") or 0)
    return LaunchInfo(kind, rank, local, world, local_size, rank // local_size, max(1, world // local_size),
                      **_slurm_ids(env), master_addr=env.get("MASTER_ADDR", ""),  # type: ignore[arg-type]
                      master_port=port)


def _srun(env: Mapping[str, str]) -> LaunchInfo:
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if "SLURM_STEP_ID" not in env and ntasks > 1:
        raise LaunchError(f"this process runs in the batch script of job {env.get('SLURM_JOB_ID')}, not in a job "
                          f"step: the job has {ntasks} tasks but only this process started. Start the ranks with "
                          "srun (python -m hpc_train render writes a script that does)")
    node = _int(env, "SLURM_NODEID")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    return LaunchInfo("srun", _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), ntasks,
                      tasks_on_node(spec, node), node, _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES"),
                      **_slurm_ids(env))  # type: ignore[arg-type]


def _submitit_local(env: Mapping[str, str]) -> LaunchInfo:
    world = _int(env, "SUBMITIT_LOCAL_NTASKS")
    return LaunchInfo("submitit-local", _int(env, "SUBMITIT_LOCAL_GLOBALID"), _int(env, "SUBMITIT_LOCAL_LOCALID"),
                      world, world, 0, 1, "localhost", env["SUBMITIT_LOCAL_JOB_ID"], "", 0)


def _check(info: LaunchInfo, expected_world: int | None) -> LaunchInfo:
    problems = []
    if not 0 <= info.rank < info.world_size:
        problems.append(f"rank {info.rank} is outside 0..{info.world_size - 1}")
    if not 0 <= info.local_rank < info.local_world_size:
        problems.append(f"local rank {info.local_rank} is outside 0..{info.local_world_size - 1}")
    if not 0 <= info.node_rank < info.num_nodes:
        problems.append(f"node rank {info.node_rank} is outside 0..{info.num_nodes - 1}")
    if info.local_world_size > info.world_size:
        problems.append(f"{info.local_world_size} ranks on this node but {info.world_size} in the job")
    if problems:
        raise LaunchError(f"{info.launcher}: " + "; ".join(problems))
    if expected_world is not None and info.world_size != expected_world:
        raise LaunchError(f"{info.launcher} started {info.world_size} ranks but the job's plan has {expected_world} "
                          "(nodes x tasks_per_node): the launch line and the plan disagree, e.g. srun -n or "
                          "--ntasks-per-node differs from the job config; render the script again")
    return info


@dataclass(frozen=True)
class Geometry:
    """What the plan asked the scheduler for: nodes, ranks on each, GPUs on each."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int


def check_geometry(info: LaunchInfo, expected: Geometry, env: Mapping[str, str] | None = None) -> None:
    """Before any process group starts: the tasks the launcher gave this rank match the plan (nodes, tasks per
    node, the step's node list, GPUs on this node), so a wrong allocation after a restart or a requeue is one
    message naming both sides instead of a hang in ``init_process_group``."""
    env = os.environ if env is None else env
    if not info.kind.allocated:
        return
    problems = []
    if info.num_nodes != expected.nodes:
        problems.append(f"ranks on {info.num_nodes} node{'s' if info.num_nodes != 1 else ''} but the plan has "
                        f"{expected.nodes} (job.nodes)")
    if info.local_world_size != expected.tasks_per_node:
        problems.append(f"{info.local_world_size} rank{'s' if info.local_world_size != 1 else ''} on node "
                        f"{info.node_rank} but the plan has {expected.tasks_per_node} (job.tasks_per_node)")
    listed = env.get("SLURM_STEP_NODELIST") or ""
    if listed and info.kind.srun:
        from hpc_train.common.hostlist import expand

        hosts = expand(listed)
        if len(hosts) != expected.nodes:
            problems.append(f"the step's node list {listed} holds {len(hosts)} node{'s' if len(hosts) != 1 else ''},"
                            f" the plan {expected.nodes}")
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and expected.gpus_per_node and int(gpus) < expected.gpus_per_node:
        problems.append(f"Slurm gave node {info.node_rank} {gpus} GPU{'s' if gpus != '1' else ''} "
                        f"(SLURM_GPUS_ON_NODE) but the plan has {expected.gpus_per_node} (job.gpus_per_node)")
    if problems:
        raise LaunchError(f"{info.launcher} started " + "; ".join(problems) + ": the allocation and the plan "
                          "disagree (a launch line changed by hand, or a restart on other nodes); submit the "
                          "config again, or render the script again")


def detect_launch(env: Mapping[str, str] | None = None, expected_world: int | None = None) -> LaunchInfo:
    """This process's place in the job; LaunchError when variables are missing or contradict each other."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        info = _torchrun(env)
    elif "CROSS_RANK" in env and "RANK" in env:
        info = _deepspeed(env)
    elif "OMPI_COMM_WORLD_RANK" in env:
        info = _mpi(env, "openmpi")
    elif "PMI_RANK" in env:
        info = _mpi(env, "mpich")
    elif "SLURM_PROCID" in env and "SLURM_JOB_ID" in env:
        info = _srun(env)
    elif "SUBMITIT_LOCAL_JOB_ID" in env:
        info = _submitit_local(env)
    elif all(name in env for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        world = _int(env, "WORLD_SIZE")
        local_size = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world)
        info = LaunchInfo("env", _int(env, "RANK"), int(env.get("LOCAL_RANK", "0")), world, local_size,
                          _int(env, "RANK") // local_size, max(1, world // local_size), "", "", "", 0,
                          master_addr=env["MASTER_ADDR"], master_port=_int(env, "MASTER_PORT"))
    elif "RANK" in env or "WORLD_SIZE" in env:
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in env]
        raise LaunchError(f"RANK/WORLD_SIZE are set but no known launcher is (missing: {', '.join(missing) or '-'});"
                          " start the ranks with srun, torchrun, mpirun or the deepspeed launcher")
    else:
        info = LaunchInfo("single", 0, 0, 1, 1, 0, 1, "localhost", str(os.getpid()), "", 0)
    return _check(info, expected_world)
