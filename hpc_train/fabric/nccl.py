"""The NCCL environment on one node: completed from what the node shows, and checked against it.

The plan fixes everything the site config says (``hpc_train.config.environment``); a few values can only be
known on the compute node: which RDMA ports are up, which GID index holds the RoCE v2 address. Each rank fills
those in before torch starts, and checks every fabric variable against the node, because a wrong one costs a
30-minute hang or a silent fall-back from InfiniBand to TCP. A value already set (site, job ``[env]``) is never
changed here: it wins, and a contradiction with the node becomes a warning that names the fix.

No torch: this runs on login nodes (doctor) and in ranks before torch is imported.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Literal

from hpc_train.fabric.sysfs import Fabric, Port, RdmaDevice

__all__ = [
    "DETECTABLE",
    "NcclFinding",
    "NodeEnv",
    "check_env",
    "detect_env",
    "detected_rows",
    "parse_device_list",
    "prepare_node_env",
]

Severity = Literal["warning", "info"]

# What a node can fill in, with the words the summary and the sbatch script use for it.
DETECTABLE: dict[str, str] = {
    "NCCL_IB_HCA": "detected on each node: its active {layer} ports, exact names",
    "NCCL_IB_GID_INDEX": "detected on each node: the RoCE v2 (IPv4) GID index of its active ports",
}
_LAYER = {"ib": "InfiniBand", "roce": "Ethernet"}
_LOOPBACK = "lo"  # sysfs readers skip lo, but it is a valid bootstrap interface on one-machine clusters


@dataclass(frozen=True)
class NcclFinding:
    """One thing about the NCCL environment that a user should know, with the fix."""

    variable: str
    severity: Severity
    message: str
    fix: str


@dataclass(frozen=True)
class NodeEnv:
    """What :func:`prepare_node_env` did on this node: values it set and what it found."""

    detected: dict[str, str] = field(default_factory=dict)
    findings: list[NcclFinding] = field(default_factory=list)


@dataclass(frozen=True)
class DeviceList:
    """An NCCL_IB_HCA / NCCL_SOCKET_IFNAME value: ``^`` excludes, ``=`` matches exactly, else prefixes match."""

    mode: Literal["include", "exact", "exclude"]
    items: list[tuple[str, int | None]]

    def matches(self, name: str, entry: str) -> bool:
        return name == entry if self.mode == "exact" else name.startswith(entry)


def parse_device_list(value: str) -> DeviceList:
    """NCCL's syntax: one optional ``^`` or ``=`` before the whole list, then ``name[:port]`` items."""
    text = value.strip()
    mode: Literal["include", "exact", "exclude"] = "include"
    if text.startswith("^"):
        mode, text = "exclude", text[1:]
    if text.startswith("="):
        mode, text = ("exact" if mode == "include" else mode), text[1:]
    items: list[tuple[str, int | None]] = []
    for part in text.split(","):
        name, _, port = part.strip().partition(":")
        if name:
            items.append((name, int(port) if (port.isascii() and port.isdigit()) else None))
    return DeviceList(mode=mode, items=items)


def _rdma_ports(fabric: Fabric, interconnect: str) -> list[tuple[RdmaDevice, Port]]:
    """Active ports of the site's kind: InfiniBand ports on an ib site, Ethernet (RoCE) ports on a roce site."""
    layer = _LAYER.get(interconnect)
    return [(dev, port) for dev, port in fabric.active_ib_ports() if layer is None or port.link_layer == layer]


def _selected_ports(fabric: Fabric, interconnect: str, hca: str | None) -> list[tuple[RdmaDevice, Port]]:
    """The active ports NCCL will use: the site's kind, narrowed by NCCL_IB_HCA when it is set."""
    ports = _rdma_ports(fabric, interconnect)
    if not hca:
        return ports
    parsed = parse_device_list(hca)

    def listed(dev: RdmaDevice, port: Port) -> bool:
        return any(parsed.matches(dev.name, name) and number in (None, port.number) for name, number in parsed.items)

    return [(d, p) for d, p in ports if listed(d, p) != (parsed.mode == "exclude")]


def detect_env(fabric: Fabric, interconnect: str, wanted: list[str],
               hca: str | None = None) -> tuple[dict[str, str], list[NcclFinding]]:
    """Values for the ``wanted`` variables from this node's fabric; findings where the node cannot give one.

    ``hca`` is an NCCL_IB_HCA already set: the GID index is then found on the ports it selects.
    """
    env: dict[str, str] = {}
    findings: list[NcclFinding] = []
    ports = _rdma_ports(fabric, interconnect)
    if "NCCL_IB_HCA" in wanted:
        if ports:
            env["NCCL_IB_HCA"] = hca = "=" + ",".join(f"{dev.name}:{port.number}" for dev, port in ports)
        else:
            findings.append(NcclFinding(
                "NCCL_IB_HCA", "warning",
                f"the site's interconnect is {interconnect}, but this node has no active "
                f"{_LAYER.get(interconnect, 'RDMA')} port: NCCL will fall back to TCP sockets",
                "check `ibstat` on the node and drain it if its ports are down, or set [network] interconnect = "
                '"tcp" for a site without RDMA'))
    selected = _selected_ports(fabric, interconnect, hca)
    if "NCCL_IB_GID_INDEX" in wanted and interconnect == "roce" and selected:
        indexes = Counter(index for _, port in selected if (index := port.roce_v2_gid_index()) is not None)
        if not indexes:
            findings.append(NcclFinding(
                "NCCL_IB_GID_INDEX", "warning", "no active RoCE port of this node has a RoCE v2 GID",
                "give the NICs an IPv4 address (RoCE v2 GIDs follow it), or set [network] gid_index"))
        else:
            index, _ = indexes.most_common(1)[0]
            env["NCCL_IB_GID_INDEX"] = str(index)
            if len(indexes) > 1:
                findings.append(NcclFinding(
                    "NCCL_IB_GID_INDEX", "warning", f"the RoCE v2 GID index differs between ports "
                    f"({sorted(indexes)}); using {index}, the most common",
                    "list only the ports that share an index in [network] hcas, or set [network] gid_index"))
    return env, findings


def detected_rows(detect: list[str], interconnect: str) -> list[tuple[str, str]]:
    """(variable, how each node finds it) for the summary and the sbatch script's comments."""
    layer = _LAYER.get(interconnect, "RDMA")
    return [(name, DETECTABLE[name].format(layer=layer)) for name in detect if name in DETECTABLE]


def _check_hca(value: str, fabric: Fabric) -> list[NcclFinding]:
    parsed = parse_device_list(value)
    names = [dev.name for dev in fabric.devices]
    have = ", ".join(names) or "none"
    findings = []
    for entry, port_number in parsed.items:
        selected = [dev for dev in fabric.devices if parsed.matches(dev.name, entry)]
        if not selected:
            findings.append(NcclFinding(
                "NCCL_IB_HCA", "warning" if parsed.mode != "exclude" else "info",
                f"{entry} is not an RDMA device of this node (it has: {have})",
                "list only devices that `ibv_devinfo -l` shows on the compute nodes"))
            continue
        if parsed.mode == "include" and any(dev.name != entry for dev in selected):
            extra = ", ".join(dev.name for dev in selected if dev.name != entry)
            findings.append(NcclFinding(
                "NCCL_IB_HCA", "warning", f"{entry} is a prefix: it also selects {extra}",
                f'start the value with "=" for exact names: ={value.lstrip("^=")}'))
        if parsed.mode == "exclude":
            continue
        for dev in selected:
            ports = [dev.port(port_number)] if port_number is not None else list(dev.ports)
            if port_number is not None and ports[0] is None:
                findings.append(NcclFinding("NCCL_IB_HCA", "warning", f"{dev.name} has no port {port_number}",
                                            f"use one of its ports: {[p.number for p in dev.ports]}"))
            elif not any(p is not None and p.active for p in ports):
                state = ", ".join(f"port {p.number} {p.state or 'unknown'}" for p in ports if p is not None)
                findings.append(NcclFinding(
                    "NCCL_IB_HCA", "warning", f"{dev.name} is listed but not active here ({state}): NCCL runs "
                    "on fewer rails, or falls back to sockets", "fix the link (`ibstat`) or exclude this node"))
    return findings


def _check_ifname(variable: str, value: str, fabric: Fabric) -> list[NcclFinding]:
    parsed = parse_device_list(value)
    if parsed.mode == "exclude":
        return []
    exact = parsed.mode == "exact" or variable == "GLOO_SOCKET_IFNAME"  # gloo takes one exact name
    up = {net.name for net in fabric.interfaces if net.operstate in ("up", "unknown")} | {_LOOPBACK}
    known = {net.name for net in fabric.interfaces} | {_LOOPBACK}
    for entry, _ in parsed.items:
        matching = [name for name in known if (name == entry if exact else name.startswith(entry))]
        if any(name in up for name in matching):
            return []
    have = ", ".join(sorted(known - {_LOOPBACK})) or "none"
    problem = "matches no interface" if not any(
        (name == e if exact else name.startswith(e)) for e, _ in parsed.items for name in known) else "is down"
    return [NcclFinding(variable, "warning", f"{value} {problem} on this node (interfaces: {have}): the "
                        "bootstrap cannot connect and the job hangs at start-up",
                        "set [network] socket_ifname to the interface holding the node's address (`ip -br addr`)")]


def _check_gid(value: str, fabric: Fabric, hca: str | None, interconnect: str) -> list[NcclFinding]:
    if not (value.strip().isascii() and value.strip().isdigit()):
        return [NcclFinding("NCCL_IB_GID_INDEX", "warning", f"{value!r} is not a GID index",
                            "give a number from `show_gids`, or leave it unset to detect it")]
    index = int(value)
    ports = _selected_ports(fabric, interconnect, hca)
    findings = []
    for dev, port in ports:
        if not port.roce:
            continue
        gid = next((g for g in port.gids if g.index == index), None)
        if gid is None or gid.type != "RoCE v2":
            kind = "no entry" if gid is None else f"a {gid.type or 'untyped'} entry"
            v2 = port.roce_v2_gid_index()
            findings.append(NcclFinding(
                "NCCL_IB_GID_INDEX", "warning", f"GID index {index} is {kind} on {dev.name}:{port.number}, not "
                "RoCE v2: traffic will not route across the fabric's L3 hops",
                f"use {v2} (RoCE v2 on this port), or leave it unset to detect it" if v2 is not None else
                "this port has no RoCE v2 GID: give its interface an IPv4 address, or leave the port out"))
    return findings


def check_env(env: Mapping[str, str], fabric: Fabric, interconnect: str) -> list[NcclFinding]:
    """Every fabric variable in ``env`` against what ``fabric`` shows; nothing found means nothing contradicts."""
    findings: list[NcclFinding] = []
    ib_disabled = env.get("NCCL_IB_DISABLE", "0").strip() == "1"
    ports = fabric.active_ib_ports()
    if ib_disabled and ports:
        findings.append(NcclFinding(
            "NCCL_IB_DISABLE", "warning", f"IB is disabled but this node has {len(ports)} active RDMA "
            "port(s): NCCL uses TCP sockets, often 10x slower", 'remove NCCL_IB_DISABLE and set [network] '
            'interconnect = "ib" or "roce"'))
    if not ib_disabled and interconnect in _LAYER and "NCCL_IB_HCA" in env:
        findings += _check_hca(env["NCCL_IB_HCA"], fabric)
    elif not ib_disabled and interconnect in _LAYER and not _rdma_ports(fabric, interconnect):
        findings += detect_env(fabric, interconnect, ["NCCL_IB_HCA"])[1]
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if env.get(variable):
            findings += _check_ifname(variable, env[variable], fabric)
    if env.get("NCCL_IB_GID_INDEX") and not ib_disabled:
        findings += _check_gid(env["NCCL_IB_GID_INDEX"], fabric, env.get("NCCL_IB_HCA"), interconnect)
    return findings


def prepare_node_env(environ: MutableMapping[str, str], interconnect: str, detect: list[str],
                     fabric: Fabric) -> NodeEnv:
    """Fill in the ``detect`` variables the environment does not already have, then check the result.

    A variable already set is left as it is: whoever set it wins, and :func:`check_env` says if the node
    disagrees. Only NCCL-related names are ever written.
    """
    wanted = [name for name in detect if name in DETECTABLE and not environ.get(name)]
    detected, findings = detect_env(fabric, interconnect, wanted, environ.get("NCCL_IB_HCA")) if wanted else ({}, [])
    environ.update(detected)
    checked = [f for f in check_env(environ, fabric, interconnect) if f not in findings]
    return NodeEnv(detected=detected, findings=findings + checked)
