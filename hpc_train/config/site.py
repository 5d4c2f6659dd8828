"""The site configuration: what one cluster looks like and how jobs must run on it.

Sites are TOML files in ``site_configs/`` (shipped with the package) or anywhere on disk. They are trusted
the way a Makefile is: a site may name modules and container images, but still goes through the same
character checks as job files, so a typo cannot become a shell command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpc_train.config.checks import (
    check_constraint,
    check_env_name,
    check_gdr_level,
    check_hca,
    check_ifname,
    check_image,
    check_mem,
    check_module,
    check_nccl_name,
    check_optional_path,
    check_path,
    check_signal,
    check_slurm_name,
    check_srun_arg,
    check_time,
)
from hpc_train.config.fields import Range, option, within

__all__ = [
    "ContainerSite",
    "LaunchSite",
    "NetworkSite",
    "NodeShape",
    "PreemptSite",
    "ReliabilitySite",
    "SiteConfig",
    "SlurmSite",
    "SoftwareSite",
]

PORTS = Range(0, 65536, fix="use two ports with 1024 <= low < high <= 65536, like [20000, 32768]")


@dataclass(frozen=True, kw_only=True)
class SlurmSite:
    """``[slurm]``: scheduler defaults applied when the job leaves them empty."""

    enabled: bool = option(True, "false for machines without Slurm (the local executor only).")
    partition: str = option("", "Default partition.", check_slurm_name)
    account: str = option("", "Default account.", check_slurm_name)
    qos: str = option("", "Default QoS.", check_slurm_name)
    constraint: str = option("", "Default node features.", check_constraint)
    max_time: str = option("", "Longest time limit the partition allows; longer jobs are refused.", check_time)
    gpu_directive: Literal["gpus-per-node", "gres"] = option(
        "gpus-per-node", "How GPUs are requested: --gpus-per-node=N or --gres=gpu:N (older sites)."
    )
    exclusive: bool = option(False, "Ask for whole nodes (--exclusive).")
    requeue: Literal["scontrol", "dependency"] = option(
        "scontrol", "How the next attempt is made after a preemption or a hang: scontrol requeue (the same job "
        'id), or "dependency" for sites that disable requeue: rank 0 submits the job\'s batch script again with '
        "--dependency=afterany:<this job>, into the same run folder.")


@dataclass(frozen=True, kw_only=True)
class NodeShape:
    """``[node]``: what one compute node has."""

    gpus: int = option(0, "GPUs per node; 0 means CPU only (gloo, no fp16).", bounds=Range(0, 64))
    gpu_type: str = option("", 'GPU model, for MFU and memory plans ("H100", "A100-80GB").')
    gpu_mem_gb: float = option(0.0, "Memory per GPU in GB.", bounds=Range(0, 1_000_000))
    cpus: int = option(0, "CPU cores per node usable by a job; 0: this machine's count, never checked (local).",
                       bounds=Range(0, 100_000))
    mem: str = option("", 'Memory per node to ask for by default ("0" = all of it).', check_mem)


@dataclass(frozen=True, kw_only=True)
class NetworkSite:
    """``[network]``: the fabric between nodes and how NCCL should use it."""

    interconnect: Literal["ib", "roce", "tcp"] = option("tcp", "ib (InfiniBand), roce (RDMA over Ethernet) or tcp.")
    hcas: list[str] = option(list, 'RDMA devices for NCCL_IB_HCA, exact names ("mlx5_0", "mlx5_0:1"; "^mlx5_1" '
                             "first to exclude); empty: each node uses its active ports.",
                             check_hca, factory=True)
    socket_ifname: str = option("", 'Interface for bootstrap traffic (NCCL_SOCKET_IFNAME; GLOO_SOCKET_IFNAME when '
                                'it is one exact name): "ib0", "=eth0", "^docker,lo".', check_ifname)
    gid_index: int = option(-1, "RoCE GID index (NCCL_IB_GID_INDEX); -1: each node finds its RoCE v2 index.",
                            bounds=Range(-1, 255))
    fabric_suffix: str = option("", 'Appended to node names to reach the fast fabric ("-ib").', check_module)
    ib_timeout: int = option(20, "NCCL_IB_TIMEOUT: a verbs retry waits 4.096 us * 2^N (1-31); 22 (~17 s) on "
                             "congested fabrics. Pinned because NCCL's default has changed between versions.",
                             bounds=within(1, 31))
    ib_retry_cnt: int = option(7, "NCCL_IB_RETRY_CNT: verbs retries before NCCL gives up (0-7).",
                               bounds=within(0, 7))
    gdr_level: str = option("", "NCCL_NET_GDR_LEVEL: LOC, PIX, PXB, PHB or SYS; empty leaves NCCL's choice "
                            "from the PCI topology (GPUs only).", check_gdr_level)
    flight_recorder: int = option(2000, "Collectives torch's NCCL flight recorder keeps per rank and dumps into "
                                  "logs/ on a timeout (TORCH_NCCL_TRACE_BUFFER_SIZE); 0 turns it off. GPUs only.",
                                  bounds=Range(0, 1_000_000))
    nccl: dict[str, str] = option(dict, "Extra NCCL_* settings, each with a reason in a comment.", check_nccl_name,
                                  factory=True)


@dataclass(frozen=True, kw_only=True)
class SoftwareSite:
    """``[software]``: how to get a working Python on a compute node."""

    modules: list[str] = option(list, "Environment modules loaded before launch.", check_module, factory=True)
    python: str = option("", "Python on compute nodes; default: the interpreter that submits.", check_path)


@dataclass(frozen=True, kw_only=True)
class ContainerSite:
    """``[container]``: an optional container every rank runs in."""

    runtime: Literal["none", "apptainer", "pyxis"] = option("none", "none, apptainer (exec) or pyxis (srun flags).")
    image: str = option("", 'Image path or reference ("/images/pt.sqsh", "nvcr.io#nvidia/pytorch:24.11-py3").',
                        check_image)
    mounts: list[str] = option(list, 'Bind mounts, "src:dst".', check_path, factory=True)


@dataclass(frozen=True, kw_only=True)
class LaunchSite:
    """``[launch]``: how ranks are started inside the allocation."""

    launcher: Literal["srun", "torchrun", "mpirun"] = option("srun", "srun, torchrun or mpirun.")
    srun_args: list[str] = option(list, 'Extra srun flags the site needs ("--mpi=pmi2", "--cpu-bind=none").',
                                  check_srun_arg, factory=True)
    port_range: list[int] = option(lambda: [20000, 32768], "Rendezvous ports are chosen in [low, high); the default "
                                   "stays below Linux's ephemeral range (32768-60999), where any outgoing "
                                   "connection on the node may already hold the port.",
                                   factory=True,
                                   bounds=PORTS)


@dataclass(frozen=True, kw_only=True)
class PreemptSite:
    """``[preempt]``: the site's preemption policy."""

    signal: str = option("USR2", "Signal Slurm sends before preemption or the time limit.", check_signal)
    lead_seconds: int = option(120, "Seconds before the end the signal is asked for (at least 60).",
                               bounds=Range(0, 7 * 24 * 3600))


@dataclass(frozen=True, kw_only=True)
class ReliabilitySite:
    """``[reliability]``: how often this site's nodes fail and how long a requeued job waits, for the checkpoint
    cadence of ``checkpoint.every_minutes = "auto"`` and the goodput the plan shows."""

    node_mtbf_hours: float = option(6300.0, "One node's mean time between failures in hours. The default is "
                                            "Llama 3's 2,048-node training: 419 unexpected interruptions in 54 "
                                            "days (54 x 24 x 2,048 / 419 = 6,300 node-hours); use your site's.",
                                            bounds=Range(0, 10**9))
    queue_wait_minutes: float = option(30.0, "Typical wait of a requeued job in the queue, in minutes: what a "
                                             "restart inside the job saves (a guess to replace with your "
                                             "site's figure, from sacct's Submit and Start).",
                                             bounds=Range(0, 365 * 24 * 60))


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    """A whole site file."""

    name: str = option("", "Short name of the site.", check_slurm_name)
    description: str = option("", "One line on what this site is.")
    run_root: str = option("", "Default folder for run folders (a shared, fast file system).", check_path)
    prometheus_dir: str = option("", "node_exporter's textfile-collector folder for jobs with [monitor] prometheus "
                                     "(one .prom file per run); empty: the run folder.", check_optional_path)
    slurm: SlurmSite = option(SlurmSite, "", factory=True)
    node: NodeShape = option(NodeShape, "", factory=True)
    network: NetworkSite = option(NetworkSite, "", factory=True)
    software: SoftwareSite = option(SoftwareSite, "", factory=True)
    container: ContainerSite = option(ContainerSite, "", factory=True)
    launch: LaunchSite = option(LaunchSite, "", factory=True)
    preempt: PreemptSite = option(PreemptSite, "", factory=True)
    reliability: ReliabilitySite = option(ReliabilitySite, "", factory=True)
    env: dict[str, str] = option(dict, "Variables exported on every rank.", check_env_name, factory=True)
