"""Read a node's fabric (RDMA devices, network interfaces, GPUs) from sysfs, without torch or ibverbs.

Everything is read from a root given as a parameter (default ``/sys``) so tests run on fixture trees. sysfs is
made of symlinks; they are resolved by hand, inside the root, so an absolute or ``..`` link in a fixture can
never reach the real ``/sys``. A missing or unreadable attribute becomes None: a probe must not crash a node.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Fabric",
    "Gid",
    "Gpu",
    "NetInterface",
    "Port",
    "RdmaDevice",
    "read_fabric",
]

FabricKind = Literal["infiniband", "roce", "tcp"]

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IPV4_MAPPED_PREFIX = "0000:0000:0000:0000:0000:ffff:"
ROCE_V2 = "RoCE v2"
NVIDIA_VENDOR = "0x10de"
# PCI class codes: 0x0300 VGA-compatible display controller, 0x0302 3D controller (datacenter GPUs).
GPU_CLASSES = ("0x0300", "0x0302")
ARPHRD_ETHER = 1
ARPHRD_INFINIBAND = 32
_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
_MAX_LINK_HOPS = 40


# --- reading a sysfs tree -----------------------------------------------------------------------------------


class SysfsTree:
    """A sysfs root; paths are resolved component by component so links stay inside it."""

    def __init__(self, root: str | os.PathLike[str] = "/sys") -> None:
        self.root = Path(os.path.abspath(root))

    def resolve(self, rel: str) -> Path | None:
        """The real path of ``rel`` (relative to the root) with every link followed inside the root; None on loops."""
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        current = self.root
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                current = current.parent if current != self.root else current
                continue
            candidate = current / part
            if not candidate.is_symlink():
                current = candidate
                continue
            hops += 1
            if hops > _MAX_LINK_HOPS:
                return None
            try:
                target = os.readlink(candidate)
            except OSError:
                return None
            if target.startswith("/"):
                # An absolute link means "from the sysfs root": /sys/devices/x and /devices/x both land there.
                current = self.root
                target = target[len("/sys"):] if target == "/sys" or target.startswith("/sys/") else target
            parts[:0] = [p for p in target.split("/") if p not in ("", ".")]
        return current

    def read(self, rel: str) -> str | None:
        """A sysfs attribute without its trailing newline; None when missing or unreadable (EINVAL on down links)."""
        path = self.resolve(rel)
        if path is None:
            return None
        try:
            return path.read_text(errors="replace").strip()
        except (OSError, ValueError):
            return None

    def read_int(self, rel: str) -> int | None:
        """An integer attribute (decimal or 0x hex); None when missing or not a number."""
        text = self.read(rel)
        if text is None:
            return None
        try:
            return int(text, 0)
        except ValueError:
            return None

    def listdir(self, rel: str, natural: bool = True) -> list[str]:
        """Entry names, sorted naturally (mlx5_2 before mlx5_10) or plainly (hex PCI addresses); [] when missing."""
        path = self.resolve(rel)
        if path is None:
            return []
        try:
            names = os.listdir(path)
        except OSError:
            return []
        return sorted(names, key=_natural_key) if natural else sorted(names)

    def numa_node(self, rel: str) -> int | None:
        """NUMA node of a device folder; sysfs says -1 when the platform does not know it."""
        node = self.read_int(f"{rel}/numa_node")
        return node if node is not None and node >= 0 else None

    def pci_address(self, device_rel: str) -> str | None:
        """PCI address of a ``device`` link: its resolved basename, else PCI_SLOT_NAME from its uevent."""
        path = self.resolve(device_rel)
        if path is not None and _PCI_ADDRESS.match(path.name):
            return path.name
        for line in (self.read(f"{device_rel}/uevent") or "").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "PCI_SLOT_NAME" and value.strip():
                return value.strip()
        return None


def _natural_key(name: str) -> list[Any]:
    return [(0, int(tok), "") if (tok.isascii() and tok.isdigit()) else (1, 0, tok)
            for tok in re.split(r"([0-9]+)", name) if tok]


def _after_colon(text: str | None) -> str | None:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``: the name is what people and NCCL logs use."""
    if text is None:
        return None
    _, sep, name = text.partition(":")
    return (name if sep else text).strip() or None


def _rate_gbps(text: str | None) -> float | None:
    match = _RATE.match(text or "")
    return float(match.group(1)) if match else None


# --- what a node has ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gid:
    """One used GID table entry; RoCE v2 with an IPv4-mapped address is what routes across L3 fabrics."""

    index: int
    gid: str
    type: str | None = None
    ndev: str | None = None

    @property
    def ipv4_mapped(self) -> bool:
        return self.gid.lower().startswith(IPV4_MAPPED_PREFIX)

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address inside an IPv4-mapped GID (``...:ffff:0ae0:0005`` -> ``10.224.0.5``)."""
        if not self.ipv4_mapped:
            return None
        groups = self.gid.split(":")[-2:]
        try:
            value = int(groups[0], 16) << 16 | int(groups[1], 16)
        except (ValueError, IndexError):
            return None
        return ".".join(str(value >> shift & 0xFF) for shift in (24, 16, 8, 0))


@dataclass(frozen=True)
class Port:
    """One port of an RDMA device; link_layer "Ethernet" means RoCE."""

    number: int
    state: str | None = None
    phys_state: str | None = None
    rate_gbps: float | None = None
    rate: str | None = None
    link_layer: str | None = None
    gids: tuple[Gid, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def roce(self) -> bool:
        return self.link_layer == "Ethernet"

    @property
    def netdev(self) -> str | None:
        """The Ethernet interface behind a RoCE port (from its GID table), the one NCCL_SOCKET_IFNAME could name."""
        return next((g.ndev for g in self.gids if g.ndev), None)

    def roce_v2_gid_index(self) -> int | None:
        """Lowest RoCE v2 index with an IPv4-mapped GID, else the lowest RoCE v2 index: what NCCL_IB_GID_INDEX needs."""
        v2 = [g for g in self.gids if g.type == ROCE_V2]
        mapped = [g for g in v2 if g.ipv4_mapped]
        best = min(mapped or v2, key=lambda g: g.index, default=None)
        return best.index if best else None


@dataclass(frozen=True)
class RdmaDevice:
    """An RDMA device (``mlx5_0``) as NCCL_IB_HCA names it, with the NUMA node and PCI address for GPU pairing."""

    name: str
    node_guid: str | None = None
    numa_node: int | None = None
    pci_address: str | None = None
    ports: tuple[Port, ...] = ()

    def port(self, number: int) -> Port | None:
        return next((p for p in self.ports if p.number == number), None)


@dataclass(frozen=True)
class NetInterface:
    """A network interface; type 32 is IPoIB, the usual bootstrap network on InfiniBand clusters."""

    name: str
    operstate: str | None = None
    type: int | None = None
    speed_mbps: int | None = None
    mtu: int | None = None
    numa_node: int | None = None

    @property
    def link(self) -> str:
        return {ARPHRD_ETHER: "ethernet", ARPHRD_INFINIBAND: "ipoib"}.get(self.type or -1, "other")


@dataclass(frozen=True)
class Gpu:
    """An NVIDIA GPU on the PCI bus, visible without a driver or CUDA."""

    pci_address: str
    device_id: str | None = None
    numa_node: int | None = None


@dataclass(frozen=True)
class Fabric:
    """What one node has: RDMA devices, network interfaces and GPUs, read from ``root``."""

    devices: tuple[RdmaDevice, ...] = ()
    interfaces: tuple[NetInterface, ...] = ()
    gpus: tuple[Gpu, ...] = ()
    root: str = field(default="/sys", compare=False)

    def active_ib_ports(self) -> list[tuple[RdmaDevice, Port]]:
        """Active ports of every RDMA device, InfiniBand and RoCE alike (NCCL's IB transport drives both)."""
        return [(dev, port) for dev in self.devices for port in dev.ports if port.active]

    def device(self, name: str) -> RdmaDevice | None:
        return next((d for d in self.devices if d.name == name), None)

    def roce_v2_gid_index(self, device: str, port: int = 1) -> int | None:
        """The GID index NCCL should use on ``device:port``; None when the port is unknown or has no RoCE v2 GID."""
        dev = self.device(device)
        found = dev.port(port) if dev else None
        return found.roce_v2_gid_index() if found else None

    @property
    def kind(self) -> FabricKind:
        """infiniband if any active port is IB (RoCE beside it is usually storage), roce if only RoCE, else tcp."""
        layers = {port.link_layer for _, port in self.active_ib_ports()}
        if "InfiniBand" in layers:
            return "infiniband"
        if "Ethernet" in layers:
            return "roce"
        return "tcp"

    @property
    def interconnect(self) -> Literal["ib", "roce", "tcp"]:
        """``kind`` spelled as the site config's ``[network] interconnect``."""
        return "ib" if self.kind == "infiniband" else self.kind

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``: the dataclasses plus the derived kind, active ports and GID choices."""
        data = asdict(self)
        for dev_data, dev in zip(data["devices"], self.devices, strict=True):
            for port_data, port in zip(dev_data["ports"], dev.ports, strict=True):
                port_data["roce_v2_gid_index"] = port.roce_v2_gid_index() if port.roce else None
                port_data["netdev"] = port.netdev
        data["kind"] = self.kind
        data["interconnect"] = self.interconnect
        data["active_ports"] = [f"{dev.name}:{port.number}" for dev, port in self.active_ib_ports()]
        return data


# --- reading each part ----------------------------------------------------------------------------------------


def _read_gids(tree: SysfsTree, port_rel: str) -> tuple[Gid, ...]:
    gids = []
    for name in tree.listdir(f"{port_rel}/gids"):
        if not (name.isascii() and name.isdigit()):
            continue
        gid = tree.read(f"{port_rel}/gids/{name}")
        if not gid or gid.lower() == ZERO_GID:
            continue
        gids.append(Gid(index=int(name), gid=gid.lower(), type=tree.read(f"{port_rel}/gid_attrs/types/{name}"),
                        ndev=tree.read(f"{port_rel}/gid_attrs/ndevs/{name}") or None))
    return tuple(gids)


def _read_port(tree: SysfsTree, port_rel: str, number: int) -> Port:
    rate = tree.read(f"{port_rel}/rate")
    return Port(number=number, state=_after_colon(tree.read(f"{port_rel}/state")),
                phys_state=_after_colon(tree.read(f"{port_rel}/phys_state")), rate_gbps=_rate_gbps(rate), rate=rate,
                link_layer=tree.read(f"{port_rel}/link_layer"), gids=_read_gids(tree, port_rel))


def _read_device(tree: SysfsTree, name: str) -> RdmaDevice:
    rel = f"class/infiniband/{name}"
    ports = tuple(_read_port(tree, f"{rel}/ports/{n}", int(n)) for n in tree.listdir(f"{rel}/ports")
                  if n.isascii() and n.isdigit())
    return RdmaDevice(name=name, node_guid=tree.read(f"{rel}/node_guid"), numa_node=tree.numa_node(f"{rel}/device"),
                      pci_address=tree.pci_address(f"{rel}/device"), ports=ports)


def _read_interface(tree: SysfsTree, name: str) -> NetInterface:
    rel = f"class/net/{name}"
    speed = tree.read_int(f"{rel}/speed")
    return NetInterface(name=name, operstate=tree.read(f"{rel}/operstate"), type=tree.read_int(f"{rel}/type"),
                        speed_mbps=speed if speed is not None and speed > 0 else None,
                        mtu=tree.read_int(f"{rel}/mtu"), numa_node=tree.numa_node(f"{rel}/device"))


def _read_gpus(tree: SysfsTree) -> tuple[Gpu, ...]:
    gpus = []
    for addr in tree.listdir("bus/pci/devices", natural=False):
        rel = f"bus/pci/devices/{addr}"
        vendor = (tree.read(f"{rel}/vendor") or "").lower()
        pci_class = (tree.read(f"{rel}/class") or "").lower()
        if vendor == NVIDIA_VENDOR and pci_class.startswith(GPU_CLASSES):
            gpus.append(Gpu(pci_address=addr, device_id=tree.read(f"{rel}/device"), numa_node=tree.numa_node(rel)))
    return tuple(gpus)


def read_fabric(root: str | os.PathLike[str] = "/sys") -> Fabric:
    """Everything the node shows under ``root``; an empty Fabric (kind "tcp") when nothing is there."""
    tree = SysfsTree(root)
    devices = tuple(_read_device(tree, name) for name in tree.listdir("class/infiniband"))
    interfaces = tuple(_read_interface(tree, name) for name in tree.listdir("class/net") if name != "lo")
    return Fabric(devices=devices, interfaces=interfaces, gpus=_read_gpus(tree), root=str(tree.root))
