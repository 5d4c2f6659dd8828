"""The collective benchmark: nccl-tests formulas, the NCCL log parser, size parsing, real gloo runs on 2 and 4
local ranks (library, CLI table and JSON, the in-job path) and bad input (exit 2, torch never imported)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hpc_train.bench.cli import format_size, parse_sizes
from hpc_train.bench.collectives import bandwidths, bus_factor, element_counts, parse_nccl_log, transport_from_nccl_log
from hpc_train.errors import ConfigError
from hpc_train.login import main as hpc_main
from tests.conftest import PYTHON, REPO, call_cli
from tests.rank.distributed.multiproc import run_workers

# ------------------------------------------------------------------------------------------- formulas


@pytest.mark.parametrize(("op", "n", "factor"), [
    ("allreduce", 1, 0.0), ("allreduce", 2, 1.0), ("allreduce", 4, 1.5), ("allreduce", 8, 1.75),
    ("allgather", 4, 0.75), ("reducescatter", 2, 0.5), ("broadcast", 8, 1.0),
])
def test_bus_factor_is_nccl_tests(op: str, n: int, factor: float) -> None:
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bandwidths() -> None:
    assert bandwidths("allreduce", 2 * 10**9, 2.0, 4) == pytest.approx((1.0, 1.5))
    assert bandwidths("allgather", 10**6, 1e-3, 2) == pytest.approx((1.0, 0.5))
    with pytest.raises(ValueError, match="not positive"):
        bandwidths("allreduce", 1024, 0.0, 2)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("alltoall", 2)


def test_element_counts_round_down_to_whole_elements_and_chunks() -> None:
    assert element_counts("allreduce", 10, 4) == (2, 2)
    assert element_counts("allreduce", 1, 4) == (1, 1)  # at least one element
    assert element_counts("allgather", 1024, 3) == (255, 85)  # whole chunks of the output
    assert element_counts("reducescatter", 1, 4) == (4, 1)  # at least one element per rank


def test_parse_sizes() -> None:
    assert parse_sizes("1K..64K") == [1024, 4096, 16384, 65536]
    assert parse_sizes("1K..8K", factor=2) == [1024, 2048, 4096, 8192]
    assert parse_sizes("4K,1M,4096, 2kb") == [2048, 4096, 1 << 20]
    assert parse_sizes("1G") == [1 << 30]
    assert [format_size(s) for s in (1024, 64 << 20, 1020, 1 << 30)] == ["1K", "64M", "1020", "1G"]
    for bad in ("12Q", "1K..", "0", "-4K"):
        with pytest.raises(ConfigError, match="--sizes"):
            parse_sizes(bad)


# ----------------------------------------------------------------------------------------- NCCL logs

IB_LOG = """\
node1:1234:1234 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
node1:1234:1234 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.1.0.1<0>
node1:1234:1290 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read
node1:1234:1290 [0] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/IB/0/GDRDMA
node1:1234:1290 [0] NCCL INFO Channel 01/0 : 4[0] -> 3[3] [receive] via NET/IB/1/GDRDMA
"""

FALLBACK_LOG = """\
node1:1234:1234 [0] NCCL INFO NET/IB : No device found.
node1:1234:1234 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
node1:1234:1290 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0
"""

SINGLE_NODE_LOG = """\
node1:1234:1234 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
node1:1234:1290 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
node1:1234:1290 [0] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via SHM/direct/direct
"""


def test_nccl_log_infiniband() -> None:
    report = parse_nccl_log(IB_LOG)
    assert report.transports == ("P2P/IPC", "NET/IB")
    assert (report.net, report.devices, report.socket_fallback) == ("IB", ("mlx5_0:1", "mlx5_1:1"), False)
    assert transport_from_nccl_log(IB_LOG) == "P2P/IPC, NET/IB (NET/IB on mlx5_0:1, mlx5_1:1)"


def test_nccl_log_socket_fallback_is_flagged() -> None:
    line = transport_from_nccl_log(FALLBACK_LOG, expect_ib=True)  # the node shows IB ports, NCCL found none
    assert line is not None
    assert line.startswith("NET/Socket (NET/Socket on eth0); WARNING: fell back to sockets")
    assert parse_nccl_log(FALLBACK_LOG, expect_ib=True).socket_fallback
    tried = FALLBACK_LOG.replace("No device found.", "Unable to open device mlx5_0")  # NCCL tried IB itself
    assert parse_nccl_log(tried).socket_fallback


def test_no_rdma_device_is_no_fall_back() -> None:
    """An Ethernet-only node: NCCL says it found no IB device and uses sockets, the only way there."""
    assert transport_from_nccl_log(FALLBACK_LOG) == "NET/Socket (NET/Socket on eth0)"
    assert not parse_nccl_log(FALLBACK_LOG).socket_fallback


def test_nccl_log_single_node_and_expectations() -> None:
    line = transport_from_nccl_log(SINGLE_NODE_LOG)
    assert line == "P2P/IPC, SHM, NET/Socket (NET/Socket on eth0)"  # no IB mentioned: sockets are no fall-back
    assert "WARNING" in (transport_from_nccl_log(SINGLE_NODE_LOG, expect_ib=True) or "")
    assert transport_from_nccl_log("NCCL INFO Bootstrap : Using ib0:10.1.0.1<0>\nhello\n") is None
    assert transport_from_nccl_log("") is None


# ------------------------------------------------------------------------------------ real gloo runs

SIZES = [1024, 4096, 65536]


def _measure_rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hpc_train.bench.collectives import measure

    out = {op: [r.to_dict() for r in measure(op, SIZES, iters=3, warmup=1)] for op in ("allreduce", "allgather")}
    value = torch.full((SIZES[-1] // 4,), float(rank + 1))  # the check the benchmark makes, made here again
    dist.all_reduce(value)
    out["sum"] = value.unique().tolist()
    return out


@pytest.mark.slow
def test_measure_on_4_ranks() -> None:
    per_rank = run_workers(_measure_rank, 4, timeout_s=120)
    assert all(report["sum"] == [10.0] for report in per_rank)  # 1 + 2 + 3 + 4
    first = per_rank[0]
    assert all(report == first for report in per_rank)  # slowest rank's time and rank 0's copy: same everywhere
    for op, factor in (("allreduce", 1.5), ("allgather", 0.75)):
        rows = first[op]
        assert [row["size"] for row in rows] == SIZES  # divisible by 4 ranks: nothing rounded away
        for row in rows:
            assert row["correct"] and row["world_size"] == 4
            assert row["time_us"] > 0 and row["algbw"] > 0 and row["copy_gbps"] > 0
            assert row["busbw"] == pytest.approx(row["algbw"] * factor)
            assert row["algbw"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9)
            assert row["ratio"] == pytest.approx(row["busbw"] / row["copy_gbps"])


@pytest.mark.slow
def test_cli_table_on_2_ranks(tmp_path: Path) -> None:
    result = call_cli(hpc_main.main, ["bench", "allreduce", "--ranks", "2", "--sizes", "1K..16K", "--iters", "3",
                                      "--warmup", "1"], tmp_path)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("# allreduce on 2 ranks, local, gloo on cpu, 1 node (")
    assert lines[1].startswith("# transport: gloo over TCP on interface lo") and "no NCCL log" in lines[1]
    rows = [line.split() for line in lines[3:-1]]
    assert [row[0] for row in rows] == ["1K", "4K", "16K"]
    for row in rows:
        assert float(row[2]) > 0 and float(row[5]) > 0 and row[-1] == "ok"


@pytest.mark.slow
def test_cli_json_on_2_ranks(tmp_path: Path) -> None:
    result = call_cli(hpc_main.main, ["bench", "allgather", "--ranks", "2", "--sizes", "1K,64K", "--iters", "3",
                                      "--warmup", "1", "--json"], tmp_path)
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert (report["op"], report["world_size"], report["where"]) == ("allgather", 2, "local")
    assert len(report["hosts"]) == 2 and report["socket_fallback"] is False and report["nccl_log"] is False
    assert [row["size"] for row in report["results"]] == [1024, 65536]
    assert all(row["correct"] and row["busbw"] == pytest.approx(row["algbw"] / 2) for row in report["results"])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_cli_joins_the_job_ranks(tmp_path: Path) -> None:
    """RANK/WORLD_SIZE set and no --ranks: both processes join one group through bootstrap; rank 0 prints."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC"))}
    base = {**clean, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    argv = [PYTHON, "-m", "hpc_train", "bench", "broadcast", "--sizes", "4K", "--iters", "2", "--json"]
    ranks = [subprocess.Popen(argv, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=90) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    report = json.loads(outputs[0][0])
    assert (report["world_size"], report["where"], report["results"][0]["size"]) == (2, "job (env)", 4096)
    assert report["rendezvous"] == f"127.0.0.1:{base['MASTER_PORT']}"
    assert report["transport"].startswith("gloo over TCP on interface lo") and not report["socket_fallback"]
    assert outputs[1][0] == ""  # only rank 0 speaks


# ------------------------------------------------------------------------------------------ bad input

BAD = [
    (["bench", "allredcue"], 'bench: "allredcue" is not a collective, did you mean "allreduce"?'),
    (["bench", "allreduce", "--sizes", "12Q"], '--sizes: "12Q" is not a size. Fix: write bytes'),
    (["bench", "allreduce", "--ranks", "0"], "--ranks: 0 local processes cannot run a collective. Fix: give 1"),
    (["bench", "allreduce", "--sizes", "4M..1K"], "write the smaller size first: 1K..4M"),
    (["bench", "allreduce", "--iters", "0"], "--iters: 0 timed calls"),
    (["bench", "allreduce", "--out", "no/such/folder/bench.json"],
     "--out: the folder no/such/folder does not exist"),
    (["bench", "allreduce", "--out", "."], "--out: . is a folder"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_exits_2_with_one_message(tmp_path: Path, args: list[str], message: str) -> None:
    result = call_cli(hpc_main.main, args, tmp_path)
    assert result.code == 2
    assert message in result.err and result.err.count("\n") == 1 and result.out == ""


def test_help_and_bad_input_never_import_torch() -> None:
    script = ("import contextlib, io, json, sys\nfrom hpc_train.login.main import main\ncodes = []\n"
              f"for args in {[a for a, _ in BAD] + [['bench', '--help']]!r}:\n"
              "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
              "        try:\n            codes.append(main(args))\n"
              "        except SystemExit as e:\n            codes.append(e.code)\n"
              "print(json.dumps([codes, 'torch' in sys.modules]))\n")
    done = subprocess.run([PYTHON, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == [[2] * len(BAD) + [0], False]
