"""The environment every rank gets: threads, the site's NCCL / InfiniBand tuning, site and job variables."""

from __future__ import annotations

from hpc_train.config.job import JobConfig
from hpc_train.config.site import NetworkSite, SiteConfig

__all__ = ["network_env", "rank_env"]


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
            env["NCCL_IB_HCA"] = ",".join(network.hcas)
        if network.interconnect == "roce" and network.gid_index >= 0:
            env["NCCL_IB_GID_INDEX"] = str(network.gid_index)
    env.update(network.nccl)
    return env


def rank_env(cfg: JobConfig, site: SiteConfig, cpus_per_task: int) -> dict[str, str]:
    """Merged in order of precedence: defaults < network < site [env] < job [env]."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(cpus_per_task)}
    env.update(network_env(site.network))
    env.update(site.env)
    env.update(cfg.env)
    return env
