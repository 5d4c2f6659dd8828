"""``python -m hpc_train.fabric [--sysfs ROOT] [--json]``: what fabric this node has, before NCCL guesses."""

from __future__ import annotations

import argparse
import json
import sys

from hpc_train.fabric.sysfs import Fabric, read_fabric

__all__ = ["main"]


def _dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _print_tables(fabric: Fabric) -> None:
    """Rich tables; rich is imported here so ``--json`` stays as light as possible."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or logged: rich's 80-column default would cut device names short
    ports = Table(title="RDMA ports", title_justify="left")
    for column in ("device", "port", "state", "phys", "rate", "link layer", "NUMA", "PCI", "netdev", "RoCE v2 GID"):
        ports.add_column(column, no_wrap=True)
    for dev in fabric.devices:
        for port in dev.ports:
            style = None if port.active else "dim"
            ports.add_row(dev.name, str(port.number), _dash(port.state), _dash(port.phys_state), _dash(port.rate),
                          _dash(port.link_layer), _dash(dev.numa_node), _dash(dev.pci_address), _dash(port.netdev),
                          _dash(port.roce_v2_gid_index() if port.roce else None), style=style)
    nets = Table(title="Network interfaces", title_justify="left")
    for column in ("name", "state", "link", "speed (Mb/s)", "MTU", "NUMA"):
        nets.add_column(column, no_wrap=True)
    for net in fabric.interfaces:
        nets.add_row(net.name, _dash(net.operstate), net.link, _dash(net.speed_mbps), _dash(net.mtu),
                     _dash(net.numa_node))
    gpus = Table(title="NVIDIA GPUs (PCI)", title_justify="left")
    for column in ("PCI", "device", "NUMA"):
        gpus.add_column(column, no_wrap=True)
    for gpu in fabric.gpus:
        gpus.add_row(gpu.pci_address, _dash(gpu.device_id), _dash(gpu.numa_node))
    if fabric.devices:
        console.print(ports)
    else:
        console.print(f"No RDMA devices under {fabric.root}/class/infiniband.")
    console.print(nets)
    if fabric.gpus:
        console.print(gpus)
    active = len(fabric.active_ib_ports())
    console.print(f"[bold]fabric:[/bold] {fabric.kind} ({active} active RDMA port{'s' if active != 1 else ''}, "
                  f"site interconnect = \"{fabric.interconnect}\")")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_train.fabric", description=__doc__)
    parser.add_argument("--sysfs", default="/sys", metavar="ROOT", help="sysfs root to read (default: /sys)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    fabric = read_fabric(args.sysfs)
    if args.json:
        json.dump(fabric.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_tables(fabric)
    return 0


if __name__ == "__main__":
    sys.exit(main())
