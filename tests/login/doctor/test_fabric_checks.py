"""This node's fabric and NCCL environment against the site, on fixture sysfs trees."""

from __future__ import annotations

from pathlib import Path

from hpc_train.fabric.sysfs import read_fabric
from hpc_train.login.doctor.fabric_checks import check_fabric, check_nccl, nccl_env
from tests.fabric.test_sysfs import ethernet_node, ndr_node, roce_node


def test_ib_site_on_a_login_node_without_rdma(tmp_path: Path) -> None:
    ethernet_node(tmp_path)
    (finding,) = check_fabric(read_fabric(tmp_path), "ib", "ndr-h100", in_job=False, host="login1")
    assert finding.severity == "warning" and finding.check == "fabric"
    assert 'site ndr-h100 says interconnect = "ib", but this node (login1) has no active RDMA port' in finding.message
    assert "SLURM_JOB_ID is unset" in finding.message and "may be normal" in finding.message
    assert "srun -N1 python -m hpc_train doctor --site ndr-h100 --no-probe" in finding.fix
    (in_job,) = check_fabric(read_fabric(tmp_path), "ib", "ndr-h100", in_job=True, host="gpu7")
    assert in_job.severity == "warning" and "SLURM_JOB_ID" not in in_job.message


def test_matching_and_mismatching_fabrics(tmp_path: Path) -> None:
    ndr = read_fabric(ndr_node(tmp_path / "ndr").root)
    (ok,) = check_fabric(ndr, "ib", "ndr-h100", in_job=True, host="gpu7")
    assert ok.severity == "ok" and "infiniband, 8 active RDMA ports" in ok.message
    (wrong,) = check_fabric(ndr, "roce", "roce-h100", in_job=True, host="gpu7")
    assert wrong.severity == "warning" and "are InfiniBand" in wrong.message
    assert 'network.interconnect = "ib"' in wrong.fix
    (unused,) = check_fabric(ndr, "tcp", "local", in_job=True, host="gpu7")
    assert unused.severity == "info" and "8 active RDMA port(s)" in unused.message
    roce = read_fabric(roce_node(tmp_path / "roce").root)
    assert check_fabric(roce, "roce", "roce-h100", in_job=True, host="r1")[0].severity == "ok"
    (tcp,) = check_fabric(read_fabric(ethernet_node(tmp_path / "eth").root), "tcp", "local", in_job=False, host="x")
    assert tcp.severity == "ok" and "no RDMA" in tcp.message


def test_nccl_findings_come_from_the_fabric_package(tmp_path: Path) -> None:
    ndr = read_fabric(ndr_node(tmp_path, down=("mlx5_3",)).root)
    env = {"NCCL_IB_HCA": "=mlx5_0,mlx5_3,mlx5_9", "NCCL_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": "8"}
    findings = check_nccl(env, ndr, "ib")
    assert {f.severity for f in findings} == {"warning"} and {f.check for f in findings} == {"nccl"}
    messages = "\n".join(f.message for f in findings)
    assert "NCCL_IB_HCA: mlx5_9 is not an RDMA device" in messages
    assert "NCCL_IB_HCA: mlx5_3 is listed but not active" in messages
    assert all(f.fix for f in findings)
    (ok,) = check_nccl({"NCCL_IB_HCA": "=mlx5_0:1", "NCCL_SOCKET_IFNAME": "ib0"}, ndr, "ib")
    assert ok.severity == "ok" and "2 NCCL/gloo variables" in ok.message


def test_ib_disabled_on_a_node_with_active_ports(tmp_path: Path) -> None:
    ndr = read_fabric(ndr_node(tmp_path).root)
    (finding,) = check_nccl({"NCCL_IB_DISABLE": "1"}, ndr, "tcp")
    assert finding.severity == "warning" and finding.message.startswith("NCCL_IB_DISABLE: IB is disabled")


def test_only_communication_variables_are_shown() -> None:
    env = {"OMP_NUM_THREADS": "4", "NCCL_IB_HCA": "=mlx5_0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
           "GLOO_SOCKET_IFNAME": "ib0", "PYTHONUNBUFFERED": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
    assert list(nccl_env(env)) == ["GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "TORCH_FR_BUFFER_SIZE",
                                   "TORCH_NCCL_ASYNC_ERROR_HANDLING"]


def test_a_node_without_rdma_does_not_flag_every_listed_hca(tmp_path: Path) -> None:
    login = read_fabric(ethernet_node(tmp_path).root)
    env = {"NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2", "NCCL_IB_TIMEOUT": "20", "NCCL_SOCKET_IFNAME": "=eth0"}
    (finding,) = check_nccl(env, login, "ib")
    assert finding.severity == "info" and "NCCL_IB_* variables not checked" in finding.message
    findings = check_nccl({**env, "NCCL_SOCKET_IFNAME": "=ib0"}, login, "ib")
    assert [f.severity for f in findings] == ["info", "warning"]  # the socket interface is still checked
    assert findings[1].message.startswith("NCCL_SOCKET_IFNAME: =ib0 matches no interface")
