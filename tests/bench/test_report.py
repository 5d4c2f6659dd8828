"""What the bench reports beside its numbers: node names, NCCL's log asked for, read and judged across ranks,
and gloo saying plainly that it has no NCCL log. The job path's NCCL wiring runs here without a GPU: bootstrap
and measure are replaced, so the test sees the order (log requested before the group starts) and the report."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hpc_train.bench import report
from hpc_train.bench.collectives import Result
from hpc_train.login import main as hpc_main
from tests.bench.test_collectives import FALLBACK_LOG, IB_LOG, SINGLE_NODE_LOG
from tests.conftest import call_cli


def test_describe_hosts_names_distinct_nodes_in_rank_order() -> None:
    assert report.describe_hosts(["n1", "n1", "n2", "n2"]) == "2 nodes (n1, n2)"
    assert report.describe_hosts(["vm", "vm"]) == "1 node (vm)"
    assert report.describe_hosts([f"gpu{i}" for i in range(10)]) == "10 nodes (gpu0, gpu1, gpu2, gpu3, ... 6 more)"


def test_node_name_prefers_slurm() -> None:
    assert report.node_name({"SLURMD_NODENAME": "n2"}) == "n2"
    assert report.node_name({}) == os.uname().nodename


@pytest.mark.parametrize(("given", "level"), [({}, "INFO"), ({"NCCL_DEBUG": "WARN"}, "INFO"),
                                              ({"NCCL_DEBUG": "trace"}, "trace")])
def test_request_nccl_log_raises_the_level_and_keeps_a_users_file(tmp_path: Path, given: dict[str, str],
                                                                  level: str) -> None:
    env = dict(given)
    assert report.request_nccl_log(env, str(tmp_path)) == str(tmp_path / "nccl.%p.log")
    assert env["NCCL_DEBUG"] == level
    mine = {"NCCL_DEBUG_FILE": "/scratch/nccl.%h.%p.txt"}
    assert report.request_nccl_log(mine, str(tmp_path)) == "/scratch/nccl.%h.%p.txt"


def test_read_nccl_log_expands_host_and_pid(tmp_path: Path) -> None:
    (tmp_path / "nccl.n1.42.log").write_text(IB_LOG)
    assert report.read_nccl_log(str(tmp_path / "nccl.%h.%p.log"), host="n1.cluster.example", pid=42) == IB_LOG
    assert report.read_nccl_log(str(tmp_path / "nccl.%h.%p.log"), host="n2", pid=42) == ""


def test_transport_lines_keep_one_channel_line_per_transport() -> None:
    many = IB_LOG + "".join(f"n:1:2 [0] NCCL INFO Channel {c:02d}/0 : 0[0] -> 1[1] via P2P/IPC/read\n"
                            for c in range(32))
    kept = report.transport_lines(many)
    assert len(kept) == 4  # NET/Plugin, NET/IB : Using, one P2P/IPC channel, one NET/IB channel
    assert report.transport_lines("hello\nNCCL INFO Bootstrap : Using ib0\n") == []


def test_nccl_transport_across_ranks() -> None:
    ranks = [report.transport_lines(SINGLE_NODE_LOG), report.transport_lines(FALLBACK_LOG)]
    assert not report.nccl_transport(ranks, expect_ib=False)["socket_fallback"]  # no RDMA: sockets are the way
    judged = report.nccl_transport(ranks, expect_ib=True)
    assert judged["socket_fallback"] and judged["nccl_log"]  # the node has IB ports, rank 1 used sockets
    assert judged["transport"].startswith("nccl: P2P/IPC, SHM, NET/Socket") and "WARNING" in judged["transport"]
    healthy = report.nccl_transport([report.transport_lines(IB_LOG)], expect_ib=True)
    assert healthy == {"transport": "nccl: P2P/IPC, NET/IB (NET/IB on mlx5_0:1, mlx5_1:1)",
                       "socket_fallback": False, "nccl_log": True}
    silent = report.nccl_transport([[], []], expect_ib=True, environ={"NCCL_DEBUG_SUBSYS": "COLL"})
    assert silent["transport"] == "nccl: its log names no transport (NCCL_DEBUG_SUBSYS=COLL may leave out INIT)"
    assert not silent["socket_fallback"]


def test_gloo_says_plainly_it_has_no_nccl_log() -> None:
    judged = report.gloo_transport({"GLOO_SOCKET_IFNAME": "ib0"})
    assert judged["transport"].startswith("gloo over TCP on interface ib0 (GLOO_SOCKET_IFNAME); no NCCL log")
    assert not judged["socket_fallback"] and not judged["nccl_log"]
    assert "fell back" not in report.gloo_transport({})["transport"]


def _ib_node(root: Path) -> Path:
    """A sysfs tree with one active InfiniBand port, mlx5_0:1."""
    port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("InfiniBand\n")
    return root


def test_expects_ib_from_the_nodes_ports(tmp_path: Path) -> None:
    assert not report.expects_ib({"HPC_TRAIN_SYSFS": str(tmp_path)})  # an empty sysfs: no RDMA device
    _ib_node(tmp_path)
    assert report.expects_ib({"HPC_TRAIN_SYSFS": str(tmp_path)})
    assert not report.expects_ib({"HPC_TRAIN_SYSFS": str(tmp_path), "NCCL_IB_DISABLE": "1"})


# ------------------------------------------------------------------- the job path's NCCL wiring, no GPU


def _fake_bootstrap(seen: dict[str, Any]) -> Any:
    """A bootstrap that checks NCCL was asked for its log first, writes NCCL's fall-back log where NCCL would,
    starts a one-rank gloo group and says the backend is nccl."""

    def bootstrap() -> Any:
        import torch.distributed as dist

        from hpc_train.rank.distributed.bootstrap import DistContext
        from hpc_train.rank.distributed.launchers import detect_launch
        from hpc_train.rank.distributed.rendezvous import Rendezvous

        seen["NCCL_DEBUG"] = os.environ["NCCL_DEBUG"]
        pattern = os.environ["NCCL_DEBUG_FILE"]
        Path(pattern.replace("%h", os.uname().nodename.split(".")[0]).replace("%p", str(os.getpid()))) \
            .write_text(FALLBACK_LOG)
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
        return DistContext(detect_launch(), Rendezvous("127.0.0.1", 29999), "nccl")

    return bootstrap


def _fake_measure(op: str, sizes: list[int], iters: int, warmup: int, group: Any = None,
                  device: Any = "cpu") -> list[Result]:
    assert str(device) == "cuda:0"
    return [Result(op, size, size // 4, 1, 10.0, 0.1, 0.0, 1.0, 0.0, True) for size in sizes]


def test_job_path_reads_nccls_log_and_flags_the_fall_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_PROCID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                        "SLURMD_NODENAME": "n7", "NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": "",
                        "HPC_TRAIN_SYSFS": str(_ib_node(tmp_path / "sys"))}.items():  # the node has IB
        monkeypatch.setenv(name, value)
    seen: dict[str, Any] = {}
    monkeypatch.setattr("hpc_train.rank.distributed.bootstrap.bootstrap", _fake_bootstrap(seen))
    monkeypatch.setattr("hpc_train.bench.collectives.measure", _fake_measure)
    result = call_cli(hpc_main.main, ["bench", "allreduce", "--sizes", "4K", "--json", "--out", "bench.json"],
                      tmp_path)
    assert result.code == 0, result.err
    assert seen["NCCL_DEBUG"] == "INFO"  # raised from WARN before the group started
    printed = json.loads(result.out)
    assert printed == json.loads((tmp_path / "bench.json").read_text())
    assert (printed["backend"], printed["hosts"], printed["socket_fallback"]) == ("nccl", ["n7"], True)
    assert printed["transport"].startswith("nccl: NET/Socket (NET/Socket on eth0); WARNING: fell back to sockets")
    assert result.err.startswith("warning: bench allreduce: nccl: NET/Socket")
    assert not list(Path(tempfile.gettempdir()).glob(f"hpc_train-bench-*/nccl.{os.getpid()}.log"))  # removed
