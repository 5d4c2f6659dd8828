"""``retry.shrink``'s arithmetic: the largest node count left that keeps the model-parallel size and the global
batch, and the plan a rank of that smaller life runs under. The agents and the ranks on the local cluster:
tests/slurm/test_preemption_e2e.py's ``test_with_no_spare_left_a_lost_node_s_job_goes_on_at_half_the_size``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.plan import make_plan, plan_for_life, shrunk_plan
from hpc_train.config.shrink import SHRUNK_NODES_ENV, ShrinkRule, ShrunkSize
from hpc_train.config.sites import load_site
from hpc_train.errors import ConfigError


def test_the_largest_count_left_that_keeps_the_layout_and_the_global_batch() -> None:
    # 4 nodes x 2 tasks, tensor 2: data 4, micro 2, accumulation 1, global 8.
    assert ShrinkRule(2, 2, 8, 2).size(3) == ShrunkSize(2, 4, 2, 2)  # data 3 does not divide 8: one node waits
    assert ShrinkRule(2, 2, 8, 2).size(1) == ShrunkSize(1, 2, 1, 4)
    assert ShrinkRule(4, 2, 8, 1).size(3) is None  # 1-3 ranks cannot hold tensor x pipeline = 4
    assert ShrinkRule(1, 4, 12, 1).size(2) == ShrunkSize(1, 1, 1, 3)  # data 2 would need 12 / (4 x 2) steps: 1 node


def test_a_rank_of_the_smaller_life_plans_the_same_global_batch_with_more_accumulation(tmp_path: Path) -> None:
    cfg = build(JobConfig, {"job": {"nodes": 2, "tasks_per_node": 2}, "train": {"micro_batch": 2},
                            "retry": {"shrink": True}})
    plan = make_plan(cfg, load_site("local-slurm"), "slurm", cwd=tmp_path)
    assert (plan.layout.world, plan.layout.data, plan.layout.grad_accum, plan.layout.global_batch) == (4, 4, 1, 8)
    assert plan.shrink_rule == ShrinkRule(1, 2, 8, 2)  # what the agents and each rank of a smaller life ask
    small = plan_for_life(plan, {SHRUNK_NODES_ENV: "1"})
    assert (small.layout.world, small.layout.data, small.layout.grad_accum) == (2, 2, 2)
    assert small.layout.global_batch == 8 and small.config.train.grad_accum == 2
    assert small.resources.nodes == 1 and small.config.job.nodes == 1 and small.config_hash == plan.config_hash
    assert plan_for_life(plan, {}) is plan and shrunk_plan(plan, 2) is plan
    with pytest.raises(ValueError, match="only hpc_train's agent sets it"):
        plan_for_life(make_plan(build(JobConfig, {"job": {"nodes": 2}}), load_site("local-slurm"), "slurm",
                                cwd=tmp_path), {SHRUNK_NODES_ENV: "1"})
    with pytest.raises(ConfigError, match="only hpc_train's agent sets it"):
        plan_for_life(plan, {SHRUNK_NODES_ENV: "one"})
    with pytest.raises(ConfigError, match=r"HPC_TRAIN_SHRUNK_NODES='3': 3 node\(s\) cannot keep .* Fix: unset"):
        plan_for_life(plan, {SHRUNK_NODES_ENV: "3"})


def test_a_plan_json_of_the_earlier_layout_still_loads(tmp_path: Path) -> None:
    """Before retry.shrink was held once, plan.json carried it in resources too: such a run folder still reads."""
    import json

    from hpc_train.config.plan import Plan

    plan = make_plan(build(JobConfig, {"job": {"nodes": 2}, "retry": {"shrink": True}}), load_site("local-slurm"),
                     "slurm", cwd=tmp_path)
    data = json.loads(plan.to_json())
    data["resources"]["shrink"] = True
    assert Plan.from_json(json.dumps(data)) == plan and plan.survives_lost_node
