"""The NCCL environment: plan-time values from the site, node-time detection and checks on fixture sysfs trees."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_train.config.environment import detected_on_node, network_env, rank_env, torch_nccl_env
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.site import NetworkSite, SiteConfig
from hpc_train.fabric.nccl import (
    NcclFinding,
    check_env,
    detect_env,
    detected_rows,
    parse_device_list,
    prepare_node_env,
)
from hpc_train.fabric.sysfs import read_fabric
from tests.fabric.test_sysfs import MAPPED, V1, Node, ethernet_node, hdr_node, ndr_node, roce_node


def network(**values: object) -> NetworkSite:
    return build(NetworkSite, values, prefix="network.")


def only(findings: list[NcclFinding], variable: str) -> list[NcclFinding]:
    return [f for f in findings if f.variable == variable]


# --- plan time: what the site says ----------------------------------------------------------------------------


def test_site_hca_list_is_written_for_exact_match() -> None:
    env = network_env(network(interconnect="ib", hcas=["mlx5_0", "mlx5_1"]))
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"  # plain "mlx5_1" would also pick mlx5_10, mlx5_11
    assert network_env(network(interconnect="ib", hcas=["^mlx5_2"]))["NCCL_IB_HCA"] == "^mlx5_2"
    assert network_env(network(interconnect="ib", hcas=["=mlx5_0", "mlx5_1"]))["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"


def test_ib_timeouts_are_pinned_and_tcp_disables_ib() -> None:
    env = network_env(network(interconnect="roce", ib_timeout=22, gid_index=3))
    assert (env["NCCL_IB_TIMEOUT"], env["NCCL_IB_RETRY_CNT"], env["NCCL_IB_GID_INDEX"]) == ("22", "7", "3")
    tcp = network_env(network(interconnect="tcp", socket_ifname="lo"))
    assert tcp == {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def test_site_nccl_table_wins_over_derived_values() -> None:
    env = network_env(network(interconnect="ib", ib_timeout=20, nccl={"NCCL_IB_TIMEOUT": "23"}))
    assert env["NCCL_IB_TIMEOUT"] == "23"


def test_gdr_level_is_checked_by_name() -> None:
    from hpc_train.errors import ConfigError

    with pytest.raises(ConfigError, match="PXB"):
        network(gdr_level="near")
    assert network_env(network(interconnect="ib", gdr_level="PHB"))["NCCL_NET_GDR_LEVEL"] == "PHB"


def test_torch_error_handling_and_flight_recorder_only_for_gpus() -> None:
    site = build(SiteConfig, {"name": "s", "network": {"interconnect": "ib"}}, prefix="")
    cfg = build(JobConfig, {"job": {"name": "j"}})
    gpu = rank_env(cfg, site, 4, gpus_per_node=8, run_dir="/runs/j")
    assert gpu["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and gpu["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert gpu["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/j/logs/nccl-trace/rank-"
    assert not any(name.startswith("TORCH_") for name in rank_env(cfg, site, 4, gpus_per_node=0, run_dir="/r"))
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in torch_nccl_env(network(flight_recorder=0), "/r")


def test_what_each_node_detects() -> None:
    assert detected_on_node(network(interconnect="ib")) == ["NCCL_IB_HCA"]
    assert detected_on_node(network(interconnect="ib", hcas=["mlx5_0"])) == []
    assert detected_on_node(network(interconnect="roce")) == ["NCCL_IB_HCA", "NCCL_IB_GID_INDEX"]
    assert detected_on_node(network(interconnect="roce", hcas=["mlx5_0"], gid_index=3)) == []
    assert detected_on_node(network(interconnect="tcp")) == []
    rows = dict(detected_rows(["NCCL_IB_HCA"], "ib"))
    assert "active InfiniBand ports" in rows["NCCL_IB_HCA"]


def test_parse_device_list() -> None:
    assert parse_device_list("=mlx5_0:1,mlx5_3").items == [("mlx5_0", 1), ("mlx5_3", None)]
    assert parse_device_list("=mlx5_0").mode == "exact"
    assert parse_device_list("^mlx5_1").mode == "exclude"
    assert parse_device_list("mlx5").mode == "include"


# --- node time: detection ---------------------------------------------------------------------------------------


def test_ndr_node_detects_all_eight_ports(tmp_path: Path) -> None:
    ndr_node(tmp_path)
    env, findings = detect_env(read_fabric(tmp_path), "ib", ["NCCL_IB_HCA"])
    assert env == {"NCCL_IB_HCA": "=" + ",".join(f"mlx5_{i}:1" for i in range(8))}
    assert findings == []


def test_port_down_is_left_out_of_detection_and_flagged_when_user_lists_it(tmp_path: Path) -> None:
    ndr_node(tmp_path, down=("mlx5_3",))
    fabric = read_fabric(tmp_path)
    env, _ = detect_env(fabric, "ib", ["NCCL_IB_HCA"])
    assert "mlx5_3" not in env["NCCL_IB_HCA"] and "mlx5_4:1" in env["NCCL_IB_HCA"]
    environ = {"NCCL_IB_HCA": "=mlx5_0,mlx5_3"}  # set by the user: it wins, with a warning
    node = prepare_node_env(environ, "ib", ["NCCL_IB_HCA"], fabric)
    assert environ["NCCL_IB_HCA"] == "=mlx5_0,mlx5_3" and node.detected == {}
    [finding] = node.findings
    assert finding.severity == "warning" and "mlx5_3" in finding.message and "DOWN" in finding.message


def test_hca_that_does_not_exist(tmp_path: Path) -> None:
    hdr_node(tmp_path)
    [finding] = check_env({"NCCL_IB_HCA": "=mlx5_0,mlx5_9"}, read_fabric(tmp_path), "ib")
    assert "mlx5_9 is not an RDMA device" in finding.message and "mlx5_0, mlx5_1, mlx5_2, mlx5_3" in finding.message


def test_prefix_that_selects_more_devices(tmp_path: Path) -> None:
    node = Node(tmp_path)
    for i in (0, 1, 10, 11):
        node.hca(f"mlx5_{i}", f"0000:{0x50 + i:02x}:00.0", numa=0, ports={1: {}})
    fabric = read_fabric(tmp_path)
    [finding] = check_env({"NCCL_IB_HCA": "mlx5_1"}, fabric, "ib")
    assert "also selects mlx5_10, mlx5_11" in finding.message and finding.fix.endswith("=mlx5_1")
    assert check_env({"NCCL_IB_HCA": "=mlx5_1"}, fabric, "ib") == []


def test_roce_node_detects_the_v2_gid_index(tmp_path: Path) -> None:
    roce_node(tmp_path)
    fabric = read_fabric(tmp_path)
    environ: dict[str, str] = {"NCCL_IB_HCA": "=mlx5_0"}
    node = prepare_node_env(environ, "roce", ["NCCL_IB_GID_INDEX"], fabric)
    assert environ["NCCL_IB_GID_INDEX"] == "3" and node.findings == []
    # All three ports: mlx5_0 says 3, mlx5_1 only has link-local v2 entries (1), mlx5_2 none: one warning.
    env, findings = detect_env(fabric, "roce", ["NCCL_IB_HCA", "NCCL_IB_GID_INDEX"])
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_2:1"
    assert env["NCCL_IB_GID_INDEX"] in ("1", "3")
    assert [f.variable for f in findings] == ["NCCL_IB_GID_INDEX"] and "differs" in findings[0].message


def test_gid_index_of_a_v1_entry(tmp_path: Path) -> None:
    roce_node(tmp_path)
    [finding] = check_env({"NCCL_IB_HCA": "=mlx5_0", "NCCL_IB_GID_INDEX": "2"}, read_fabric(tmp_path), "roce")
    assert "GID index 2 is a IB/RoCE v1 entry on mlx5_0:1" in finding.message and finding.fix.startswith("use 3")
    assert check_env({"NCCL_IB_HCA": "=mlx5_0", "NCCL_IB_GID_INDEX": "x"}, read_fabric(tmp_path), "roce")


def test_gid_index_without_any_v2_entry(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.hca("mlx5_0", "0000:0c:00.0", numa=0, ports={1: {"layer": "Ethernet", "gids": {1: (MAPPED, V1, None)}}})
    env, [finding] = detect_env(read_fabric(tmp_path), "roce", ["NCCL_IB_GID_INDEX"])
    assert env == {} and "no active RoCE port" in finding.message
    [given] = check_env({"NCCL_IB_GID_INDEX": "1"}, read_fabric(tmp_path), "roce")
    assert "is a IB/RoCE v1 entry" in given.message and given.fix.startswith("this port has no RoCE v2 GID")


def test_ethernet_only_node_on_an_ib_site_falls_back_to_sockets(tmp_path: Path) -> None:
    ethernet_node(tmp_path)
    environ: dict[str, str] = {}
    node = prepare_node_env(environ, "ib", ["NCCL_IB_HCA"], read_fabric(tmp_path))
    assert "NCCL_IB_HCA" not in environ
    [finding] = node.findings
    assert "fall back to TCP sockets" in finding.message


def test_socket_interfaces(tmp_path: Path) -> None:
    ethernet_node(tmp_path)
    fabric = read_fabric(tmp_path)
    assert check_env({"NCCL_SOCKET_IFNAME": "eth", "NCCL_IB_DISABLE": "1"}, fabric, "tcp") == []
    assert check_env({"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}, fabric, "tcp") == []
    assert check_env({"NCCL_SOCKET_IFNAME": "^docker,lo"}, fabric, "tcp") == []
    [missing] = check_env({"NCCL_SOCKET_IFNAME": "ib0"}, fabric, "tcp")
    assert "ib0 matches no interface" in missing.message and "eth0" in missing.message
    [down] = check_env({"GLOO_SOCKET_IFNAME": "docker0"}, fabric, "tcp")
    assert "docker0 is down" in down.message


def test_ib_disabled_on_a_node_with_active_ports(tmp_path: Path) -> None:
    hdr_node(tmp_path)
    [finding] = check_env({"NCCL_IB_DISABLE": "1"}, read_fabric(tmp_path), "tcp")
    assert finding.variable == "NCCL_IB_DISABLE" and "4 active RDMA port" in finding.message


def test_a_matching_environment_has_no_findings(tmp_path: Path) -> None:
    ndr_node(tmp_path)
    environ = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    node = prepare_node_env(environ, "ib", ["NCCL_IB_HCA"], read_fabric(tmp_path))
    assert node.findings == [] and environ["NCCL_IB_HCA"].startswith("=mlx5_0:1,")


# --- in a rank --------------------------------------------------------------------------------------------------


def test_launch_completes_and_reports_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank-side hook: NCCL_IB_HCA from the node, a warning for a user value that contradicts it, and
    logs/fabric-HOST.json for doctor and later debugging."""
    from hpc_train.rank.entry import _prepare_fabric

    sysfs = tmp_path / "sys"
    ndr_node(sysfs, down=("mlx5_7",))
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    monkeypatch.setenv("HPC_TRAIN_SYSFS", str(sysfs))
    monkeypatch.setenv("NCCL_IB_HCA", "")  # empty counts as unset; monkeypatch restores it afterwards
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib9")

    plan = SimpleNamespace(interconnect="ib", nccl_detect=["NCCL_IB_HCA"])
    messages: list[str] = []
    logger = logging.getLogger("test-fabric")
    monkeypatch.setattr(logger, "info", lambda fmt, *args: messages.append(fmt % args))
    monkeypatch.setattr(logger, "warning", lambda fmt, *args: messages.append("WARNING " + fmt % args))
    _prepare_fabric(run_dir, plan, 0, logger)  # type: ignore[arg-type]
    assert os.environ["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{i}:1" for i in range(7))
    assert any(m.startswith("WARNING fabric: NCCL_SOCKET_IFNAME: ib9 matches no interface") for m in messages)
    [report_file] = (run_dir / "logs").glob("fabric-*.json")
    report = json.loads(report_file.read_text())
    assert report["kind"] == "infiniband" and len(report["active_ports"]) == 7
    assert report["env"]["NCCL_IB_HCA"] == os.environ["NCCL_IB_HCA"]
    assert report["findings"][0]["variable"] == "NCCL_SOCKET_IFNAME"
