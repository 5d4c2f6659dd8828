"""The plan carries the typed job config and is still plain JSON: ``plan.json`` round-trips, and the config's
hash and ``config.toml`` are those of the same plain table as before."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.plan import Plan, make_plan
from hpc_train.config.sites import load_site


def _plan(tmp_path: Path) -> Plan:
    cfg = build(JobConfig, {"job": {"tasks_per_node": 2, "forward_env": ["WANDB_API_KEY"]},
                            "train": {"lr": 1e-3, "precision": "fp32"}, "data": {"path": "tokens.bin"},
                            "env": {"NCCL_DEBUG": "WARN"}, "deepspeed": {"wall_clock_breakdown": True}})
    return make_plan(cfg, load_site("local"), "local", cwd=tmp_path)


def test_the_config_is_typed_and_round_trips_through_plain_json(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert isinstance(plan.config, JobConfig) and plan.config.train.lr == 1e-3
    text = plan.to_json()
    assert json.loads(text)["config"]["train"]["lr"] == 1e-3  # plain JSON, no pickle
    again = Plan.from_json(text)
    assert again == plan and isinstance(again.config.train.lr, float) and again.config.job.gpus_per_node is None
    assert again.to_json() == text
    assert again.config.deepspeed == {"wall_clock_breakdown": True} and again.config.env == {"NCCL_DEBUG": "WARN"}


def test_the_data_path_is_made_absolute_before_hashing(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert plan.config.data.path == str(tmp_path / "tokens.bin")
    table = dataclasses.asdict(plan.config)
    canonical = json.dumps(table, sort_keys=True, separators=(",", ":"))
    assert plan.config_hash == hashlib.sha256(canonical.encode()).hexdigest()
