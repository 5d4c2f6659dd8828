"""Who am I: global rank, local rank, world size and rendezvous address, from whichever launcher started us.

Minimal launcher coverage for the smoke program; the full detection with conflict checks grows here.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

__all__ = ["RankInfo", "detect_ranks", "export_rendezvous"]


@dataclass(frozen=True)
class RankInfo:
    """One rank's place in the job and where the group meets."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int


def _int(name: str) -> int:
    return int(os.environ[name])


def _port(seed: str, low: int, high: int) -> int:
    return random.Random(seed).randrange(low, high)  # noqa: S311 - a port choice, not a secret


def detect_ranks(port_range: tuple[int, int] = (20000, 60000), fabric_suffix: str = "") -> RankInfo:
    """Read the launcher's variables. The rendezvous address is ours to set, never inherited by accident."""
    env = os.environ
    low, high = port_range
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "LOCAL_WORLD_SIZE" in env):
        return RankInfo("torchrun", _int("RANK"), _int("LOCAL_RANK"), _int("WORLD_SIZE"),
                        _int("LOCAL_WORLD_SIZE"), env["MASTER_ADDR"], _int("MASTER_PORT"))
    if "OMPI_COMM_WORLD_RANK" in env:
        return RankInfo("mpirun", _int("OMPI_COMM_WORLD_RANK"), _int("OMPI_COMM_WORLD_LOCAL_RANK"),
                        _int("OMPI_COMM_WORLD_SIZE"), _int("OMPI_COMM_WORLD_LOCAL_SIZE"),
                        env["MASTER_ADDR"], _int("MASTER_PORT"))
    if "SUBMITIT_LOCAL_JOB_ID" in env:
        job = env["SUBMITIT_LOCAL_JOB_ID"]
        world = _int("SUBMITIT_LOCAL_NTASKS")
        return RankInfo("submitit-local", _int("SUBMITIT_LOCAL_GLOBALID"), _int("SUBMITIT_LOCAL_LOCALID"),
                        world, world, "127.0.0.1", _port(f"local-{job}", low, high))
    if "SLURM_PROCID" in env and "SLURM_JOB_ID" in env:
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
        local_size = int(per_node.split("(")[0].split(",")[0])
        if env.get("HPC_TRAIN_RENDEZVOUS") == "sbatch":
            addr, port = env["MASTER_ADDR"], _int("MASTER_PORT")
        else:  # submitit on Slurm: first host of the job, port from the job id and restart count
            import submitit

            addr = submitit.JobEnvironment().hostnames[0] + fabric_suffix
            restart = env.get("SLURM_RESTART_COUNT", "0")
            port = _port(f"slurm-{env['SLURM_JOB_ID']}-{restart}", low, high)
        return RankInfo("srun", _int("SLURM_PROCID"), _int("SLURM_LOCALID"), _int("SLURM_NTASKS"),
                        local_size, addr, port)
    return RankInfo("single", 0, 0, 1, 1, "127.0.0.1", _port(f"single-{socket.gethostname()}-{os.getpid()}",
                                                             low, high))


def export_rendezvous(info: RankInfo) -> None:
    """Set the five variables so that neither torch nor DeepSpeed guesses (or reuses a leaked value)."""
    os.environ.update(
        RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
        LOCAL_SIZE=str(info.local_world_size), LOCAL_WORLD_SIZE=str(info.local_world_size),
        MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port),
    )
