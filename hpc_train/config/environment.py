"""The environment every rank gets: threads, the site's NCCL / InfiniBand tuning, site and job variables.

This is the part fixed at submission, shown in the summary and written into sbatch scripts. What only a
compute node can know (its active ports, its RoCE v2 GID index) is named by :func:`detected_on_node` and filled
in by each rank (``hpc_train.fabric.nccl``).
"""

from __future__ import annotations

from hpc_train.config.job import JobConfig
from hpc_train.config.site import NetworkSite, SiteConfig
from hpc_train.run.paths import FLIGHT_RECORDER_DIR

__all__ = ["detected_on_node", "network_env", "rank_env", "torch_nccl_env"]

FLIGHT_RECORDER_PREFIX = f"{FLIGHT_RECORDER_DIR}/rank-"  # torch appends the rank


def _exact_hcas(hcas: list[str]) -> str:
    """Site HCA lists are exact names: "mlx5_1" must not also select mlx5_10 and mlx5_11 (NCCL matches prefixes)."""
    value = ",".join(hcas)
    return value if value.startswith(("=", "^")) else "=" + value


def network_env(network: NetworkSite) -> dict[str, str]:
    """NCCL and gloo variables implied by the interconnect; explicit ``[network.nccl]`` entries win."""
    env: dict[str, str] = {}
    ifname = network.socket_ifname
    if ifname:
        env["NCCL_SOCKET_IFNAME"] = ifname
        exact = ifname.removeprefix("=")
        if exact.isidentifier() or exact.replace(".", "").replace("-", "").isalnum():
            env["GLOO_SOCKET_IFNAME"] = exact  # gloo takes one exact name, no prefixes or exclusions
    if network.interconnect == "tcp":
        env["NCCL_IB_DISABLE"] = "1"
    else:
        if network.hcas:
            env["NCCL_IB_HCA"] = _exact_hcas(network.hcas)
        if network.interconnect == "roce" and network.gid_index >= 0:
            env["NCCL_IB_GID_INDEX"] = str(network.gid_index)
        env["NCCL_IB_TIMEOUT"] = str(network.ib_timeout)
        env["NCCL_IB_RETRY_CNT"] = str(network.ib_retry_cnt)
        if network.gdr_level:
            env["NCCL_NET_GDR_LEVEL"] = network.gdr_level
    env.update(network.nccl)
    return env


def torch_nccl_env(network: NetworkSite, run_dir: str) -> dict[str, str]:
    """torch's NCCL watchdog settings for GPU jobs: a failed collective ends the process (so the job ends and can
    requeue) and, with the flight recorder on, every rank first dumps its last collectives into ``logs/``.
    Both spellings of the flight recorder's variables are set: torch renamed them (TORCH_FR_*) in 2.7."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    if network.flight_recorder > 0:
        prefix = f"{run_dir}/{FLIGHT_RECORDER_PREFIX}"
        env.update({
            "TORCH_NCCL_TRACE_BUFFER_SIZE": str(network.flight_recorder),
            "TORCH_FR_BUFFER_SIZE": str(network.flight_recorder),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
            "TORCH_FR_DUMP_TEMP_FILE": prefix,
        })
    return env


def detected_on_node(network: NetworkSite) -> list[str]:
    """NCCL variables the site leaves to each node: the HCA list when none is given, the RoCE v2 GID index."""
    names = []
    if network.interconnect != "tcp" and not network.hcas and "NCCL_IB_HCA" not in network.nccl:
        names.append("NCCL_IB_HCA")
    if network.interconnect == "roce" and network.gid_index < 0 and "NCCL_IB_GID_INDEX" not in network.nccl:
        names.append("NCCL_IB_GID_INDEX")
    return names


def rank_env(cfg: JobConfig, site: SiteConfig, cpus_per_task: int, gpus_per_node: int = 0,
             run_dir: str = "") -> dict[str, str]:
    """Merged in order of precedence: defaults < network < site [env] < job [env]."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(cpus_per_task)}
    if gpus_per_node > 0:
        env.update(torch_nccl_env(site.network, run_dir))
    env.update(network_env(site.network))
    if site.slurm.requeue == "dependency":
        env["HPC_TRAIN_REQUEUE"] = "dependency"  # hpc_train.run.chain: the next attempt is a new job
    env.update(site.env)
    env.update(cfg.env)
    return env
