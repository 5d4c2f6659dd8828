"""Rank detection per launcher, from the variables each launcher really sets."""

from __future__ import annotations

import pytest

from hpc_train.dist.ranks import detect_ranks, export_rendezvous

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                 "MASTER_PORT", "SUBMITIT_LOCAL_JOB_ID", "SLURM_PROCID", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK",
                 "HPC_TRAIN_RENDEZVOUS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_submitit_local_ignores_a_leaked_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "203.0.113.7")
    for name, value in {"SUBMITIT_LOCAL_JOB_ID": "77", "SUBMITIT_LOCAL_NTASKS": "4", "SUBMITIT_LOCAL_GLOBALID": "3",
                        "SUBMITIT_LOCAL_LOCALID": "3"}.items():
        monkeypatch.setenv(name, value)
    info = detect_ranks((30000, 30100))
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("submitit-local", 3, 4, "127.0.0.1")
    assert 30000 <= info.master_port < 30100
    assert detect_ranks((30000, 30100)).master_port == info.master_port  # every rank derives the same port


def test_srun_with_rendered_script(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "9",
                        "SLURM_TASKS_PER_NODE": "2(x4)", "HPC_TRAIN_RENDEZVOUS": "sbatch", "MASTER_ADDR": "n1-ib",
                        "MASTER_PORT": "23456"}.items():
        monkeypatch.setenv(name, value)
    info = detect_ranks()
    assert (info.launcher, info.rank, info.local_rank, info.world_size, info.local_world_size) == ("srun", 5, 1, 8, 2)
    assert (info.master_addr, info.master_port) == ("n1-ib", 23456)


def test_export_sets_all_five_and_local_size(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n2", "MASTER_PORT": "20001"}.items():
        monkeypatch.setenv(name, value)
    info = detect_ranks()
    export_rendezvous(info)
    import os

    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR")] == [
        "2", "4", "0", "2", "n2"]
