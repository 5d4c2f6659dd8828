"""Fabric detection from fixture sysfs trees laid out like the real one (relative links into devices/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.fabric import Fabric, Port, read_fabric
from hpc_train.fabric.__main__ import main
from hpc_train.fabric.sysfs import SysfsTree

REPO = Path(__file__).resolve().parents[2]
NDR_RATE = "400 Gb/sec (4X NDR)"
HDR_RATE = "200 Gb/sec (4X HDR)"
LINK_LOCAL = "fe80:0000:0000:0000:0e42:a1ff:fe00:0001"
MAPPED = "0000:0000:0000:0000:0000:ffff:0ae0:0005"  # 10.224.0.5
V1, V2 = "IB/RoCE v1", "RoCE v2"


class Node:
    """Writes a sysfs-shaped tree: devices under devices/pci0000:00/, class/ and bus/ entries as relative links."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def file(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def link(self, rel: str, target: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)

    def pci(self, addr: str, *, numa: int, vendor: str = "0x15b3", cls: str = "0x020700",
            device: str = "0x1021") -> str:
        rel = f"devices/pci0000:00/{addr}"
        for name, value in (("numa_node", str(numa)), ("vendor", vendor), ("class", cls), ("device", device),
                            ("uevent", f"DRIVER=x\nPCI_SLOT_NAME={addr}")):
            self.file(f"{rel}/{name}", value)
        self.link(f"bus/pci/devices/{addr}", f"../../../{rel}")
        return rel

    def hca(self, name: str, addr: str, *, numa: int, ports: dict[int, dict]) -> None:
        pci = self.pci(addr, numa=numa)
        rel = f"{pci}/infiniband/{name}"
        self.file(f"{rel}/node_guid", f"0c42:a103:00{addr[5:7]}:0000")
        self.link(f"{rel}/device", f"../../../{addr}")
        self.link(f"class/infiniband/{name}", f"../../{rel}")
        for number, spec in ports.items():
            self.port(f"{rel}/ports/{number}", **spec)

    def port(self, rel: str, *, state: str = "4: ACTIVE", phys: str = "5: LinkUp", rate: str = NDR_RATE,
             layer: str = "InfiniBand", gids: dict[int, tuple[str, str, str | None]] | None = None) -> None:
        self.file(f"{rel}/state", state)
        self.file(f"{rel}/phys_state", phys)
        self.file(f"{rel}/rate", rate)
        self.file(f"{rel}/link_layer", layer)
        gids = gids if gids is not None else {0: (LINK_LOCAL, V1, None)}
        for index in range(max(gids, default=0) + 2):  # trailing unused entries are all zeros, as in sysfs
            gid, kind, ndev = gids.get(index, ("0000:0000:0000:0000:0000:0000:0000:0000", "", None))
            self.file(f"{rel}/gids/{index}", gid)
            if kind:
                self.file(f"{rel}/gid_attrs/types/{index}", kind)
            if ndev:
                self.file(f"{rel}/gid_attrs/ndevs/{index}", ndev)

    def net(self, name: str, *, type_: int = 1, state: str = "up", speed: str | None = "100000", mtu: int = 1500,
            pci: str | None = None) -> None:
        rel = f"{pci}/net/{name}" if pci else f"devices/virtual/net/{name}"
        for attr, value in (("operstate", state), ("type", str(type_)), ("speed", speed), ("mtu", str(mtu))):
            if value is not None:
                self.file(f"{rel}/{attr}", value)
        if pci:
            self.link(f"{rel}/device", f"../../../{pci.rsplit('/', 1)[1]}")
        self.link(f"class/net/{name}", f"../../{rel}")

    def gpus(self, count: int, *, numa_nodes: int, first_bus: int = 0x18) -> None:
        for i in range(count):
            self.pci(f"0000:{first_bus + i:02x}:00.0", numa=i * numa_nodes // count, vendor="0x10de", cls="0x030200",
                     device="0x2330")


def ndr_node(root: Path, down: tuple[str, ...] = ()) -> Node:
    """DGX H100 style: mlx5_0..7 at 400 Gb/s, 4 per socket, 8 GPUs on 2 NUMA nodes, IPoIB ib0, eth0."""
    node = Node(root)
    for i in range(8):
        name = f"mlx5_{i}"
        port = {"state": "1: DOWN", "phys": "3: Disabled"} if name in down else {}
        node.hca(name, f"0000:{0x50 + i:02x}:00.0", numa=i // 4, ports={1: port})
    node.gpus(8, numa_nodes=2)
    node.net("eth0", pci=node.pci("0000:c0:00.0", numa=0, cls="0x020000"), speed="100000")
    node.net("ib0", type_=32, mtu=4092, speed=None, pci="devices/pci0000:00/0000:50:00.0")
    node.net("lo", type_=772, state="unknown", speed=None, mtu=65536)
    return node


def hdr_node(root: Path) -> Node:
    """JUWELS Booster style: 4 HDR HCAs at 200 Gb/s, one per NUMA domain of its GPU, 4 A100s."""
    node = Node(root)
    for i in range(4):
        node.hca(f"mlx5_{i}", f"0000:{0x20 + i:02x}:00.0", numa=2 * i + 1, ports={1: {"rate": HDR_RATE}})
    node.gpus(4, numa_nodes=4, first_bus=0x40)
    node.net("ib0", type_=32, mtu=2044, speed="-1")
    return node


ROCE_GIDS = {
    0: (LINK_LOCAL, V1, "rdma0"),
    1: (LINK_LOCAL, V2, "rdma0"),
    2: (MAPPED, V1, "rdma0"),
    3: (MAPPED, V2, "rdma0"),
}


def roce_node(root: Path) -> Node:
    """OCI style: Ethernet link layer, GID table v1/v2 with the IPv4-mapped v2 entry at index 3."""
    node = Node(root)
    rate = "200 Gb/sec (4X HDR)"
    node.hca("mlx5_0", "0000:0c:00.0", numa=0, ports={1: {"layer": "Ethernet", "rate": rate, "gids": ROCE_GIDS}})
    # Only link-local v2 entries: fall back to the lowest v2 index.
    node.hca("mlx5_1", "0000:0d:00.0", numa=0, ports={1: {"layer": "Ethernet", "rate": rate, "gids": {
        0: (LINK_LOCAL, V1, "rdma1"), 1: (LINK_LOCAL, V2, "rdma1"), 2: ("fe80:0000:0000:0000:0e42:a1ff:fe00:0002",
                                                                      V2, "rdma1")}}})
    # v1 only: no usable index.
    node.hca("mlx5_2", "0000:0e:00.0", numa=1, ports={1: {"layer": "Ethernet", "rate": rate, "gids": {
        0: (LINK_LOCAL, V1, None), 1: (MAPPED, V1, None)}}})
    node.net("eth0", pci=node.pci("0000:c0:00.0", numa=0, cls="0x020000"), speed="50000", mtu=9000)
    node.net("rdma0", pci="devices/pci0000:00/0000:0c:00.0", speed="200000", mtu=4220)
    node.gpus(8, numa_nodes=2)
    return node


def ethernet_node(root: Path) -> Node:
    node = Node(root)
    node.net("eth0", pci=node.pci("0000:03:00.0", numa=-1, cls="0x020000"), speed="25000")
    node.net("docker0", state="down", speed=None)
    node.net("lo", type_=772, state="unknown", speed=None, mtu=65536)
    return node


# --- parsing --------------------------------------------------------------------------------------------------


def test_ndr_node(tmp_path: Path) -> None:
    ndr_node(tmp_path)
    fabric = read_fabric(tmp_path)
    assert [d.name for d in fabric.devices] == [f"mlx5_{i}" for i in range(8)]
    dev = fabric.devices[5]
    assert (dev.numa_node, dev.pci_address, dev.node_guid) == (1, "0000:55:00.0", "0c42:a103:0055:0000")
    port = dev.ports[0]
    assert (port.number, port.state, port.phys_state, port.link_layer) == (1, "ACTIVE", "LinkUp", "InfiniBand")
    assert (port.rate_gbps, port.rate) == (400.0, NDR_RATE)
    assert [(g.index, g.gid, g.type) for g in port.gids] == [(0, LINK_LOCAL, V1)]  # zero GID 1 skipped
    assert fabric.kind == "infiniband" and fabric.interconnect == "ib"
    assert [f"{d.name}:{p.number}" for d, p in fabric.active_ib_ports()] == [f"mlx5_{i}:1" for i in range(8)]
    assert len(fabric.gpus) == 8 and {g.numa_node for g in fabric.gpus} == {0, 1}
    assert [g.numa_node for g in fabric.gpus].count(0) == 4 and fabric.gpus[0].device_id == "0x2330"
    assert [i.name for i in fabric.interfaces] == ["eth0", "ib0"]  # lo skipped
    ib0 = fabric.interfaces[1]
    assert (ib0.type, ib0.link, ib0.mtu, ib0.speed_mbps, ib0.numa_node) == (32, "ipoib", 4092, None, 0)
    assert fabric.roce_v2_gid_index("mlx5_0", 1) is None


def test_hdr_node(tmp_path: Path) -> None:
    hdr_node(tmp_path)
    fabric = read_fabric(tmp_path)
    assert [(d.name, d.numa_node, d.ports[0].rate_gbps) for d in fabric.devices] == [
        ("mlx5_0", 1, 200.0), ("mlx5_1", 3, 200.0), ("mlx5_2", 5, 200.0), ("mlx5_3", 7, 200.0)]
    assert fabric.kind == "infiniband" and len(fabric.active_ib_ports()) == 4
    assert [g.numa_node for g in fabric.gpus] == [0, 1, 2, 3]
    assert fabric.interfaces[0].speed_mbps is None  # speed -1


def test_roce_node(tmp_path: Path) -> None:
    roce_node(tmp_path)
    fabric = read_fabric(tmp_path)
    assert fabric.kind == "roce" and fabric.interconnect == "roce"
    port = fabric.devices[0].ports[0]
    assert port.roce and port.netdev == "rdma0" and port.rate_gbps == 200.0
    assert [(g.index, g.type, g.ipv4) for g in port.gids] == [
        (0, V1, None), (1, V2, None), (2, V1, "10.224.0.5"), (3, V2, "10.224.0.5")]
    assert fabric.roce_v2_gid_index("mlx5_0", 1) == 3
    assert fabric.roce_v2_gid_index("mlx5_1", 1) == 1
    assert fabric.roce_v2_gid_index("mlx5_2", 1) is None
    assert fabric.roce_v2_gid_index("mlx5_0", 2) is None and fabric.roce_v2_gid_index("mlx5_9") is None
    rdma0 = next(i for i in fabric.interfaces if i.name == "rdma0")
    assert (rdma0.speed_mbps, rdma0.mtu, rdma0.numa_node) == (200000, 4220, 0)


def test_ethernet_only_node(tmp_path: Path) -> None:
    ethernet_node(tmp_path)
    fabric = read_fabric(tmp_path)
    assert fabric.devices == () and fabric.gpus == () and fabric.active_ib_ports() == []
    assert fabric.kind == "tcp"
    docker0, eth0 = fabric.interfaces
    assert (eth0.name, eth0.speed_mbps, eth0.numa_node, eth0.link) == ("eth0", 25000, None, "ethernet")  # numa -1
    assert (docker0.operstate, docker0.speed_mbps, docker0.numa_node) == ("down", None, None)


def test_port_down(tmp_path: Path) -> None:
    ndr_node(tmp_path, down=("mlx5_3",))
    fabric = read_fabric(tmp_path)
    port = fabric.device("mlx5_3").ports[0]
    assert (port.state, port.phys_state, port.active) == ("DOWN", "Disabled", False)
    active = [d.name for d, _ in fabric.active_ib_ports()]
    assert len(active) == 7 and "mlx5_3" not in active
    assert fabric.kind == "infiniband"


def test_all_ports_down_is_tcp(tmp_path: Path) -> None:
    hdr = Node(tmp_path)
    hdr.hca("mlx5_0", "0000:20:00.0", numa=0, ports={1: {"state": "1: DOWN", "phys": "2: Polling"}})
    assert read_fabric(tmp_path).kind == "tcp"


def test_ib_beside_roce_is_infiniband(tmp_path: Path) -> None:
    node = ndr_node(tmp_path)
    node.hca("mlx5_8", "0000:a0:00.0", numa=0, ports={1: {"layer": "Ethernet", "gids": ROCE_GIDS}})
    fabric = read_fabric(tmp_path)
    assert fabric.kind == "infiniband" and len(fabric.active_ib_ports()) == 9


# --- robustness -----------------------------------------------------------------------------------------------


def test_missing_attributes_are_none(tmp_path: Path) -> None:
    (tmp_path / "class/infiniband/mlx5_0/ports/1").mkdir(parents=True)
    (tmp_path / "class/net/eth0").mkdir(parents=True)
    fabric = read_fabric(tmp_path)
    dev = fabric.devices[0]
    assert (dev.node_guid, dev.numa_node, dev.pci_address) == (None, None, None)
    assert dev.ports[0] == Port(number=1)
    assert fabric.interfaces[0].operstate is None and fabric.interfaces[0].type is None
    assert fabric.kind == "tcp"


def test_uevent_gives_pci_address_when_device_is_no_link(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.file("class/infiniband/mlx5_0/device/uevent", "DRIVER=mlx5_core\nPCI_SLOT_NAME=0000:07:00.0")
    node.file("class/infiniband/mlx5_0/device/numa_node", "-1")
    dev = read_fabric(tmp_path).devices[0]
    assert (dev.pci_address, dev.numa_node) == ("0000:07:00.0", None)


def test_links_stay_inside_the_root(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.file("devices/x/infiniband/mlx5_0/ports/1/state", "4: ACTIVE")
    node.file("devices/x/infiniband/mlx5_0/ports/1/link_layer", "InfiniBand")
    node.link("class/infiniband/mlx5_0", "/sys/devices/x/infiniband/mlx5_0")  # absolute: re-rooted
    node.link("class/infiniband/mlx5_1", "/devices/x/infiniband/mlx5_0")
    node.link("class/infiniband/mlx5_2", "../../../../../../../../devices/x/infiniband/mlx5_0")  # clamped at root
    node.link("class/infiniband/mlx5_3", "../../nowhere")  # dangling
    node.link("class/infiniband/mlx5_4", "mlx5_5")  # loop
    node.link("class/infiniband/mlx5_5", "mlx5_4")
    node.link("class/net/eth0", "/etc")  # would escape; inside the root it is just missing
    fabric = read_fabric(tmp_path)
    assert [len(d.ports) for d in fabric.devices] == [1, 1, 1, 0, 0, 0]
    assert len(fabric.active_ib_ports()) == 3
    assert fabric.interfaces[0].operstate is None
    assert SysfsTree(tmp_path).resolve("class/infiniband/mlx5_4") is None


def test_natural_device_order(tmp_path: Path) -> None:
    node = Node(tmp_path)
    for i in (10, 2, 1, 0):
        node.hca(f"mlx5_{i}", f"0000:{0x60 + i:02x}:00.0", numa=0, ports={1: {}})
    assert [d.name for d in read_fabric(tmp_path).devices] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_10"]


def test_real_sysfs_without_infiniband() -> None:
    if Path("/sys/class/infiniband").exists():
        pytest.skip("this machine has RDMA devices")
    fabric = read_fabric()
    assert isinstance(fabric, Fabric) and fabric.kind == "tcp" and fabric.devices == ()
    assert all(i.name != "lo" for i in fabric.interfaces)


# --- CLI ------------------------------------------------------------------------------------------------------


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roce_node(tmp_path)
    assert main(["--sysfs", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["kind"], data["interconnect"]) == ("roce", "roce")
    assert data["active_ports"] == ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1"]
    port = data["devices"][0]["ports"][0]
    assert (port["roce_v2_gid_index"], port["netdev"], port["rate_gbps"]) == (3, "rdma0", 200.0)
    assert port["gids"][3] == {"index": 3, "gid": MAPPED, "type": V2, "ndev": "rdma0"}
    assert [g["pci_address"] for g in data["gpus"]] == [f"0000:{bus:02x}:00.0" for bus in range(0x18, 0x20)]


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ndr_node(tmp_path, down=("mlx5_3",))
    assert main(["--sysfs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mlx5_7" in out and "DOWN" in out and "ib0" in out
    assert "fabric: infiniband (7 active RDMA ports" in out


def test_cli_subprocess_does_not_import_torch(tmp_path: Path) -> None:
    hdr_node(tmp_path)
    code = ("import runpy, sys\n"
            f"sys.argv = ['hpc_train.fabric', '--sysfs', {str(tmp_path)!r}, '--json']\n"
            "try:\n    runpy.run_module('hpc_train.fabric', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["kind"] == "infiniband" and len(data["active_ports"]) == 4
