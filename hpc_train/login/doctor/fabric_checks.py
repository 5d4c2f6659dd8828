"""This node's fabric against the site's interconnect, and the NCCL environment a job would get here."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from hpc_train.fabric.sysfs import Fabric
from hpc_train.login.doctor.findings import Finding

__all__ = ["NCCL_PREFIXES", "check_fabric", "check_nccl", "nccl_env"]

NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_")
_KIND_WORDS = {"ib": "InfiniBand", "roce": "RoCE", "tcp": "TCP only"}


def nccl_env(env: Mapping[str, str]) -> dict[str, str]:
    """The communication variables of a rank environment (NCCL, torch's NCCL watchdog, gloo), sorted."""
    return {name: env[name] for name in sorted(env) if name.startswith(NCCL_PREFIXES)}


def check_fabric(fabric: Fabric, interconnect: str, site: str, in_job: bool, host: str | None = None) -> list[Finding]:
    """The site says ib/roce/tcp; does this node agree?"""
    host = host or socket.gethostname()
    ports = fabric.active_ib_ports()
    here = f"this node ({host})"
    if interconnect in ("ib", "roce") and not ports:
        message = f'site {site} says interconnect = "{interconnect}", but {here} has no active RDMA port'
        if not in_job:
            message += ("; SLURM_JOB_ID is unset, so this is probably a login node, which often has no RDMA: "
                        "that may be normal")
        return [Finding("fabric", "warning", message,
                        f"check a compute node: srun -N1 python -m hpc_train doctor --site {site} --no-probe; "
                        f"if the cluster has no RDMA, set network.interconnect = \"tcp\" in the site")]
    if interconnect in ("ib", "roce") and fabric.interconnect != interconnect:
        return [Finding("fabric", "warning", f'site {site} says interconnect = "{interconnect}", but the active '
                        f"ports of {here} are {_KIND_WORDS[fabric.interconnect]}",
                        f'set network.interconnect = "{fabric.interconnect}" in the site, or check the ports (ibstat)')]
    if interconnect == "tcp" and ports:
        return [Finding("fabric", "info", f"{here} has {len(ports)} active RDMA port(s) ({fabric.kind}) that site "
                        f'{site} leaves unused (interconnect = "tcp")',
                        f'set network.interconnect = "{fabric.interconnect}" in the site to use them')]
    count = f"{len(ports)} active RDMA port{'s' if len(ports) != 1 else ''}" if ports else "no RDMA"
    return [Finding("fabric", "ok", f'{here}: {fabric.kind}, {count}; matches the site\'s interconnect = '
                    f'"{interconnect}"')]


def check_nccl(env: Mapping[str, str], fabric: Fabric, interconnect: str) -> list[Finding]:
    """Each NCCL variable against this node, through :func:`hpc_train.fabric.nccl.check_env`."""
    from hpc_train.fabric.nccl import check_env

    checked = check_env(dict(env), fabric, interconnect)
    found = []
    if interconnect in ("ib", "roce") and not fabric.devices:
        # A node without any RDMA device (a login node, usually) would flag every listed HCA; the fabric
        # finding already says what matters, once.
        checked = [f for f in checked if not f.variable.startswith("NCCL_IB_")]
        found.append(Finding("nccl", "info", "NCCL_IB_* variables not checked: this node has no RDMA device "
                             "(see the fabric finding)", ""))
    found += [Finding("nccl", f.severity, f"{f.variable}: {f.message}", f.fix) for f in checked]
    if found:
        return found
    shown = nccl_env(env)
    return [Finding("nccl", "ok", f"{len(shown)} NCCL/gloo variable{'s' if len(shown) != 1 else ''}; none "
                    "contradicts this node's fabric")]
