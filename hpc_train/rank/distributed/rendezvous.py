"""Where the ranks meet: MASTER_ADDR and MASTER_PORT, derived the same way on every rank without talking.

The address is the job's first node on the fast fabric (its name plus the site's suffix), checked to resolve.
The port comes from the job id and the restart count, ``low + (job_id * 7919 + restart * 104729) % span``:
the formula the sbatch templates use too, so a requeued attempt, or another job's ranks sharing a node, gets a
different port. Launchers that own the rendezvous (torchrun, the DeepSpeed launcher) are taken at their word.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from hpc_train.common.hostlist import first_host
from hpc_train.rank.distributed.launchers import LaunchError, LaunchInfo

__all__ = ["Rendezvous", "RendezvousError", "choose_rendezvous", "derive_port", "export_rendezvous"]

class RendezvousError(RuntimeError):
    """The rendezvous address does not resolve, the port is taken, or rank 0 cannot be reached."""


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int


def derive_port(job_id: str, restart: int, low: int, high: int, in_place: int = 0) -> int:
    """A port in ``[low, high)`` from the job id and restart count (the templates' formula); each restart in
    place moves it on, so a new step never meets the old one's port in TIME_WAIT."""
    digits = "".join(ch for ch in job_id if (ch.isascii() and ch.isdigit())) or "0"
    return low + (int(digits) * 7919 + restart * 104729 + in_place * 1299709) % (high - low)


def _mpi_bcast_rendezvous(info: LaunchInfo, low: int, high: int) -> Rendezvous:
    """MPI outside Slurm with no MASTER_ADDR: rank 0 tells everyone its host name and a port, over MPI."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchError(f"{info.launcher} without MASTER_ADDR/MASTER_PORT and without mpi4py: export both with "
                          "mpirun -x, or install hpc_train[mpi]") from None
    port = derive_port(str(os.getppid()), 0, low, high)
    addr, port = MPI.COMM_WORLD.bcast((socket.gethostname(), port) if info.rank == 0 else None, root=0)
    return Rendezvous(addr, port)


def choose_rendezvous(info: LaunchInfo, port_range: tuple[int, int] = (20000, 32768),
                      fabric_suffix: str = "") -> Rendezvous:
    """The address and port every rank of this job computes alike."""
    low, high = port_range
    kind = info.kind
    if kind.sets_rendezvous:
        return Rendezvous(info.master_addr, info.master_port)
    if kind.mpi and info.master_addr and info.master_port:
        return Rendezvous(info.master_addr, info.master_port)  # exported by the mpirun template
    if kind.this_machine:
        return Rendezvous("127.0.0.1", derive_port(info.job_id, info.restart, low, high, info.in_place))
    if not info.nodelist or not info.job_id:
        if kind.mpi:
            return _mpi_bcast_rendezvous(info, low, high)
        raise LaunchError(f"{info.launcher}: SLURM_JOB_NODELIST and SLURM_JOB_ID are needed to find rank 0")
    port = derive_port(info.job_id, info.restart, low, high, info.in_place)
    return Rendezvous(first_host(info.nodelist) + fabric_suffix, port)


def check_resolves(addr: str) -> None:
    """Fail at once, naming the address, when MASTER_ADDR does not resolve on this node."""
    try:
        socket.getaddrinfo(addr, None)
    except socket.gaierror as error:
        raise RendezvousError(f"MASTER_ADDR {addr!r} does not resolve on {socket.gethostname()} ({error}): check "
                              "the site's network.fabric_suffix, or that node names resolve here") from None


def export_rendezvous(info: LaunchInfo, rendezvous: Rendezvous) -> None:
    """Set the variables torch and DeepSpeed read, so that neither guesses (nor reuses a leaked value)."""
    os.environ.update(
        RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
        LOCAL_SIZE=str(info.local_world_size), LOCAL_WORLD_SIZE=str(info.local_world_size),
        MASTER_ADDR=rendezvous.addr, MASTER_PORT=str(rendezvous.port),
    )
