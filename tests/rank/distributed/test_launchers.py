"""Launcher detection and rendezvous from the variables each launcher really sets (pure logic, no torch).

The variable sets were read off real launches on the local cluster (srun 2 nodes x 2 tasks, the batch step,
torchrun, Open MPI's mpirun); the end-to-end tests in tests/slurm run the launchers themselves.
"""

from __future__ import annotations

import pytest

from hpc_train.rank.distributed.launchers import Geometry, LaunchError, check_geometry, detect_launch, tasks_on_node
from hpc_train.rank.distributed.rendezvous import RendezvousError, check_resolves, choose_rendezvous, derive_port

SRUN_RANK3 = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
              "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "n[1-2]",
              "SLURM_STEP_NODELIST": "n[1-2]"}
BATCH_STEP = {k: v for k, v in SRUN_RANK3.items() if not k.startswith("SLURM_STEP")} | {
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2(x2)"}
TORCHRUN_RANK2 = {"TORCHELASTIC_RUN_ID": "4242", "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                  "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
                  **{k: SRUN_RANK3[k] for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_JOB_NODELIST")}}
OMPI_RANK1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
              "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "23000",
              "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
MPICH_RANK5 = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
DEEPSPEED_RANK3 = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
                   "CROSS_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
SUBMITIT_LOCAL = {"SUBMITIT_LOCAL_JOB_ID": "777", "SUBMITIT_LOCAL_NTASKS": "4", "SUBMITIT_LOCAL_GLOBALID": "2",
                  "SUBMITIT_LOCAL_LOCALID": "2", "MASTER_ADDR": "203.0.113.7", "MASTER_PORT": "1"}


@pytest.mark.parametrize(("env", "expected"), [
    (SRUN_RANK3, ("srun", 3, 1, 4, 2, 1, 2)),
    (TORCHRUN_RANK2, ("torchrun", 2, 0, 4, 2, 1, 2)),
    (OMPI_RANK1, ("openmpi", 1, 1, 4, 2, 0, 2)),
    (MPICH_RANK5, ("mpich", 5, 1, 8, 4, 1, 2)),
    (DEEPSPEED_RANK3, ("deepspeed", 3, 1, 4, 2, 1, 2)),
    (SUBMITIT_LOCAL, ("submitit-local", 2, 2, 4, 4, 0, 1)),
    ({}, ("single", 0, 0, 1, 1, 0, 1)),
], ids=["srun", "torchrun", "openmpi", "mpich", "deepspeed", "submitit-local", "single"])
def test_each_launcher(env: dict[str, str], expected: tuple) -> None:
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank,
            info.num_nodes) == expected


def test_srun_rendezvous_is_the_first_node_on_the_fabric_and_a_job_derived_port() -> None:
    info = detect_launch(SRUN_RANK3)
    rendezvous = choose_rendezvous(info, (20000, 60000), "-ib")
    assert rendezvous.addr == "n1-ib"
    assert rendezvous.port == 20000 + (4242 * 7919) % 40000  # the sbatch templates' formula


def test_requeued_attempts_and_other_jobs_get_other_ports() -> None:
    ports = {derive_port(str(job), restart, 20000, 60000) for job in range(1000, 1010) for restart in range(3)}
    assert len(ports) == 30
    requeued = detect_launch(SRUN_RANK3 | {"SLURM_RESTART_COUNT": "1"})
    assert choose_rendezvous(requeued).port != choose_rendezvous(detect_launch(SRUN_RANK3)).port


def test_submitit_local_ignores_a_leaked_master_addr() -> None:
    rendezvous = choose_rendezvous(detect_launch(SUBMITIT_LOCAL), (30000, 30100))
    assert rendezvous.addr == "127.0.0.1" and 30000 <= rendezvous.port < 30100


def test_launchers_that_own_the_rendezvous_are_believed() -> None:
    assert choose_rendezvous(detect_launch(TORCHRUN_RANK2)).port == 29500
    assert choose_rendezvous(detect_launch(OMPI_RANK1)).addr == "n1"


@pytest.mark.parametrize(("env", "expected_world", "message"), [
    (BATCH_STEP, None, "runs in the batch script of job 4242, not in a job step"),
    (SRUN_RANK3, 8, "srun started 4 ranks but the job's plan has 8"),
    (SRUN_RANK3 | {"SLURM_PROCID": "4"}, None, "rank 4 is outside 0..3"),
    (SRUN_RANK3 | {"SLURM_LOCALID": "x"}, None, "SLURM_LOCALID='x' is not a number"),
    (SRUN_RANK3 | {"SLURM_STEP_TASKS_PER_NODE": "2(x"}, None, "cannot read the tasks per node '2(x'"),
    ({"RANK": "0"}, None, "RANK/WORLD_SIZE are set but no known launcher is (missing: WORLD_SIZE, MASTER_ADDR"),
    ({k: v for k, v in TORCHRUN_RANK2.items() if k != "LOCAL_WORLD_SIZE"}, None, "LOCAL_WORLD_SIZE is not set"),
    (MPICH_RANK5 | {"MPI_LOCALRANKID": "4"}, None, "local rank 4 is outside 0..3"),
])
def test_missing_or_conflicting_variables_fail_before_any_process_group(env: dict[str, str],
                                                                       expected_world: int | None,
                                                                       message: str) -> None:
    with pytest.raises(LaunchError) as error:
        detect_launch(env, expected_world=expected_world)
    assert message in str(error.value)


def test_tasks_per_node_reads_slurm_compression() -> None:
    assert [tasks_on_node("3(x2),1", node) for node in range(3)] == [3, 3, 1]


def test_an_address_that_does_not_resolve_is_named() -> None:
    with pytest.raises(RendezvousError, match=r"'n1-nosuchfabric\.invalid' does not resolve"):
        check_resolves("n1-nosuchfabric.invalid")


@pytest.mark.parametrize(("env", "geometry", "message"), [
    (SRUN_RANK3, Geometry(2, 2, 0), ""),
    (SRUN_RANK3, Geometry(4, 1, 0), "srun started ranks on 2 nodes but the plan has 4 (job.nodes); 2 ranks on node 1 "
     "but the plan has 1 (job.tasks_per_node); the step's node list n[1-2] holds 2 nodes, the plan 4"),
    (SRUN_RANK3 | {"SLURM_GPUS_ON_NODE": "1"}, Geometry(2, 2, 2),
     "Slurm gave node 1 1 GPU (SLURM_GPUS_ON_NODE) but the plan has 2 (job.gpus_per_node)"),
    (SRUN_RANK3 | {"SLURM_GPUS_ON_NODE": "4"}, Geometry(2, 2, 2), ""),
    (TORCHRUN_RANK2, Geometry(2, 4, 0), "torchrun started 2 ranks on node 1 but the plan has 4"),
    (SUBMITIT_LOCAL, Geometry(3, 9, 0), ""),  # one process tree on this machine: nothing allocated to check
])
def test_the_allocation_must_match_the_plan_before_any_process_group(env: dict[str, str], geometry: Geometry,
                                                                     message: str) -> None:
    info = detect_launch(env)
    if not message:
        check_geometry(info, geometry, env)
        return
    with pytest.raises(LaunchError) as error:
        check_geometry(info, geometry, env)
    assert message in str(error.value) and "the allocation and the plan disagree" in str(error.value)


def test_every_launcher_detect_launch_names_has_its_kind() -> None:
    """The rank side asks a launcher's kind (allocated, its own rendezvous, MPI, this machine), never its name;
    each name detect_launch can give is in the table, and a name it does not know implies nothing."""
    from hpc_train.rank.distributed.launchers import LAUNCHERS, LaunchInfo

    assert set(LAUNCHERS) == {"srun", "torchrun", "deepspeed", "openmpi", "mpich", "submitit-local", "env", "single"}
    assert [name for name, kind in LAUNCHERS.items() if kind.allocated] == ["srun", "torchrun", "deepspeed", "openmpi",
                                                                           "mpich"]
    assert [name for name, kind in LAUNCHERS.items() if kind.this_machine] == ["submitit-local", "single"]
    assert not LAUNCHERS["single"].own_process and all(k.own_process for n, k in LAUNCHERS.items() if n != "single")
    unknown = LaunchInfo("pbsdsh", 0, 0, 1, 1, 0, 1, "", "", "", 0).kind
    assert unknown.own_process and not (unknown.allocated or unknown.sets_rendezvous or unknown.this_machine)
