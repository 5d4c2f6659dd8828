"""Which nodes hold the ranks in a job with hot spares (``job.spare_nodes``): the first life's nodes, a lost
node replaced by a spare in place, the rank's ``SLURM_*`` place, and one decision per life however many agents
race to make it. The whole path on the local cluster is tests/slurm/test_preemption_e2e.py's
``test_a_lost_node_is_replaced_by_a_hot_spare_inside_the_same_job``."""

from __future__ import annotations

from pathlib import Path

from hpc_train.rank.agent.spares import settle
from hpc_train.run.assignment import (
    Assignment,
    first_assignment,
    mark_left,
    mark_task_ready,
    next_assignment,
    publish_assignment,
    rank_environment,
    rank_environments,
    ranks_left,
    read_assignment,
    ready_nodes,
)
from hpc_train.run.attempts import AttemptLog

ALLOCATED = ("n1", "n2", "n3", "n4")


def test_the_first_life_takes_the_first_nodes_the_run_does_not_exclude() -> None:
    assert first_assignment(ALLOCATED, 2).nodes == ["n1", "n2"]
    assert first_assignment(ALLOCATED, 2, excluded=["n1"]).nodes == ["n2", "n3"]
    assert first_assignment(("n1", "n2"), 2, excluded=["n1"]).nodes == ["n1", "n2"]  # too few: all of them


def test_a_lost_node_is_replaced_in_place_and_the_others_keep_their_ranks() -> None:
    life0 = Assignment(0, ["n1", "n2", "n3"])
    life1 = next_assignment(life0, healthy=["n1", "n3", "n4"], allocated=ALLOCATED, in_place=1)
    assert life1 == Assignment(1, ["n1", "n4", "n3"], ["n2"])  # rank 1's node is the spare; ranks 0, 2 stay
    assert next_assignment(life1, healthy=["n1", "n4"], allocated=ALLOCATED, in_place=2) is None  # no spare left
    assert next_assignment(life0, healthy=ALLOCATED, allocated=ALLOCATED, in_place=1) == Assignment(
        1, ["n1", "n2", "n3"], [])  # a kill -9 of one rank: every node answered, nothing moves


def test_with_no_spare_left_shrink_goes_on_with_the_nodes_left_in_their_order() -> None:
    """``retry.shrink``: a lost node with no spare leaves its place; ``smaller`` says how many of the nodes left
    keep the layout (here pairs: 3 left go on as 2, and the third waits as a spare for a later loss)."""
    pairs = lambda left: left - left % 2 or None  # noqa: E731 - the layout's rule, as the agent's Spares.smaller
    life0 = Assignment(0, ["n1", "n2", "n3", "n4"])
    life1 = next_assignment(life0, healthy=["n1", "n3", "n4"], allocated=ALLOCATED, in_place=1, smaller=pairs)
    assert life1 == Assignment(1, ["n1", "n3"], ["n2"])
    life2 = next_assignment(life1, healthy=["n1", "n4"], allocated=ALLOCATED, in_place=2, smaller=pairs)
    assert life2 == Assignment(2, ["n1", "n4"], ["n2", "n3"])  # the idle n4 took n3's place: the size is kept
    assert next_assignment(life2, healthy=["n4"], allocated=ALLOCATED, in_place=3, smaller=pairs) is None
    assert next_assignment(life0, healthy=["n1", "n3", "n4"], allocated=ALLOCATED, in_place=1) is None  # no shrink


def test_a_rank_sees_the_job_as_the_plan_drew_it() -> None:
    life = Assignment(1, ["n1", "n3"], ["n2"])
    place = rank_environment(life, "n3", local=1, tasks_per_node=2)
    assert place == {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "2",
                     "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
                     "SLURM_STEP_NUM_TASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
                     "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1,3]", "SLURM_JOB_NODELIST": "n[1,3]",
                     "SLURM_NODELIST": "n[1,3]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
                     "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert rank_environment(life, "n4", local=0, tasks_per_node=2) is None  # a spare
    both = rank_environments(life, "n3", tasks_per_node=2)  # what n3's agent starts
    assert sorted(both) == [2, 3] and both[3] == place and both[2]["SLURM_LOCALID"] == "0"
    assert rank_environments(life, "n4", tasks_per_node=2) == {}


def test_the_first_decision_of_a_life_stands(tmp_path: Path) -> None:
    first, won = publish_assignment(tmp_path, "7.0", Assignment(1, ["n1", "n3"], ["n2"]))
    second, also = publish_assignment(tmp_path, "7.0", Assignment(1, ["n1", "n3"], ["n2"]))  # the same, later
    assert won and not also
    third, _ = publish_assignment(tmp_path, "7.0", Assignment(1, ["n1", "n4"], ["n2"]))
    assert first == second == third == read_assignment(tmp_path, "7.0", 1) == Assignment(1, ["n1", "n3"], ["n2"])
    assert read_assignment(tmp_path, "7.0", 2) is None


def test_ready_marks_count_tasks_per_node_and_the_left_mark_frees_the_spares(tmp_path: Path) -> None:
    for task, node in ((0, "n1"), (1, "n1"), (2, "n3")):
        mark_task_ready(tmp_path, "7.0", 1, task, node)
    assert ready_nodes(tmp_path, "7.0", 1, tasks=6) == {"n1": 2, "n3": 1}
    assert not ranks_left(tmp_path, "7.0")
    mark_left(tmp_path, "7.0")
    assert ranks_left(tmp_path, "7.0") and not ranks_left(tmp_path, "7.1")


def test_the_batch_script_settles_on_what_the_run_says_of_its_job(tmp_path: Path) -> None:
    """srun's status is non-zero when a lost node's task was killed; the job is what its run completed."""
    log = AttemptLog(tmp_path)
    log.finish(log.begin("7", 0, "n1", 1.0, 0), outcome="killed")
    assert settle(tmp_path, 137, "7") == 137
    log.finish(log.begin("7", 0, "n1", 2.0, 10, in_place=1), outcome="completed")
    assert settle(tmp_path, 137, "7") == 0
    assert settle(tmp_path, 137, "8") == 137  # another job's completion says nothing of this one
