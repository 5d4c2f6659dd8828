"""``python -m hpc_train doctor`` without a cluster: bad input, a site without Slurm, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_train.login.main import main
from tests.conftest import REPO, call_cli
from tests.fabric.test_sysfs import ndr_node

JOB = '[job]\nname = "doctor-test"\nnodes = 1\ntasks_per_node = 2\ntime = "00:10:00"\n'


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return path


@pytest.mark.parametrize(("args", "message"), [
    (["--probe-timeout", "0"], "--probe-timeout: 0.0 is not a positive number of seconds"),
    (["--probe-timeout", "nan"], "--probe-timeout: nan is not a positive number of seconds"),
    (["--probe-timeout", "soon"], "argument --probe-timeout: invalid float value: 'soon'"),
    (["--set", "job.nodes=2"], "--set: needs a job config"),
    (["--nodes", "0"], "--nodes: 0 is below the minimum 1"),
    (["--ntasks-per-node", "-1"], "--ntasks-per-node: -1 is below the minimum 1"),
    (["--sysfs", "/nonexistent/sys"], "--sysfs: /nonexistent/sys is not a folder"),
    (["--site", "nosuch-site"], 'no site named "nosuch-site"'),
    (["--config", "missing.toml"], "missing.toml"),
    (["--config", "job.toml", "--set", "job.nodes=two"], "job.nodes"),
    (["--config", "job.toml", "--set", "job.name=a\nb"], "job.name"),
])
def test_bad_input_exits_2_with_one_message(tmp_path: Path, job: Path, args: list[str], message: str) -> None:
    result = call_cli(main, ["doctor", "--site", "local", *args], tmp_path)
    assert result.code == 2, result.out + result.err
    assert result.out == ""
    assert result.err.count("error:") == 1 and message in result.err, result.err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_site_without_slurm_checks_fabric_and_nccl(tmp_path: Path, job: Path) -> None:
    ndr_node(tmp_path / "sys")
    result = call_cli(main, ["doctor", "--site", "local", "--config", "job.toml", "--sysfs", "sys", "--json"], tmp_path)
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert set(data) >= {"findings", "fabric", "nccl_env", "probe"}
    checks = {(f["check"], f["severity"]) for f in data["findings"]}
    assert ("slurm", "info") in checks and ("fabric", "info") in checks  # 8 RDMA ports the tcp site leaves unused
    assert ("nccl", "warning") in checks  # NCCL_IB_DISABLE=1 on a node with active ports
    assert data["nccl_env"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}
    assert data["fabric"]["kind"] == "infiniband" and data["probe"] is None
    assert all(f["fix"] for f in data["findings"] if f["severity"] in ("warning", "error"))


def test_tables_when_not_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line a finding, with or without a terminal (xdist lanes have none)
    ndr_node(tmp_path / "sys", down=("mlx5_3",))
    result = call_cli(main, ["doctor", "--site", "local", "--sysfs", "sys"], tmp_path)
    assert result.code == 0, result.err
    for text in ("RDMA ports", "NCCL environment", "NCCL_IB_DISABLE", "Findings", "no Slurm ([slurm] enabled",
                 "doctor: 1 warning"):
        assert text in result.out, text


def test_variables_each_node_detects_are_named(tmp_path: Path) -> None:
    ndr_node(tmp_path / "sys")
    (tmp_path / "ib.toml").write_text('name = "ib-lab"\n[slurm]\nenabled = false\n[network]\ninterconnect = "ib"\n')
    result = call_cli(main, ["doctor", "--site", "./ib.toml", "--sysfs", "sys", "--json"], tmp_path)
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["nccl_detect"] == ["NCCL_IB_HCA"] and "NCCL_IB_HCA" not in data["nccl_env"]
    assert [f["severity"] for f in data["findings"] if f["check"] in ("fabric", "nccl")] == ["ok", "ok"]
    table = call_cli(main, ["doctor", "--site", "./ib.toml", "--sysfs", "sys"], tmp_path)
    assert "each node, at start" in table.out


def test_doctor_does_not_import_torch(tmp_path: Path, job: Path) -> None:
    ndr_node(tmp_path / "sys")
    code = ("import runpy, sys\n"
            f"sys.argv = ['hpc_train', 'doctor', '--site', 'local', '--config', {str(job)!r}, '--sysfs', "
            f"{str(tmp_path / 'sys')!r}, '--json']\n"
            "try:\n    runpy.run_module('hpc_train', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "import hpc_train.login.doctor.probe, hpc_train.login.doctor.probe_task, hpc_train.login.doctor.run\n"
            "heavy = sorted(m for m in ('torch', 'deepspeed', 'numpy') if m in sys.modules)\n"
            "assert not heavy, f'imported {heavy}'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fabric"]["kind"] == "infiniband"
