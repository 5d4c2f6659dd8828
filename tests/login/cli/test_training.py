"""The plan's training section: what trains (model and size, data, engine, precision, steps and tokens), the
checkpoint cadence and the resume point, for the presets, a user model, programs and a run folder to resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpc_train.checkpoint import CheckpointManager
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.plan import Plan, make_plan
from hpc_train.config.sites import load_site
from hpc_train.login.cli.training import training_rows, training_summary
from tests.conftest import REPO

EXAMPLE = str(REPO / "examples" / "tiny_gpt.toml")


def _plan(tmp_path: Path, site: str = "local", executor: str = "local", **sections: dict[str, Any]) -> Plan:
    return make_plan(build(JobConfig, sections), load_site(site), executor, cwd=tmp_path)


def _rows(plan: Plan) -> dict[str, str]:
    return dict(training_rows(training_summary(plan)))


@pytest.mark.parametrize(("preset", "parameters"), [("tiny", 470_528), ("125M", 85_498_368)])
def test_a_preset_says_its_size_steps_and_tokens(tmp_path: Path, preset: str, parameters: int) -> None:
    plan = _plan(tmp_path, job={"tasks_per_node": 2}, train={"model": preset, "steps": 30, "micro_batch": 4,
                                                             "seq_len": 64, "precision": "fp32",
                                                             "optimizer": "cpu_adam"},
                 zero={"stage": 3, "offload_optimizer": True})
    summary = training_summary(plan)
    assert summary.kind == "trainer" and summary.model["parameters"] == parameters
    assert summary.tokens == 30 * 4 * 2 * 64 and summary.steps == 30
    assert summary.engine["zero_stage"] == 3 and summary.engine["offload_optimizer"] is True
    rows = _rows(plan)
    assert f"({parameters:,}) parameters" in rows["model"]
    assert rows["engine"].startswith("DeepSpeed ZeRO-3, optimizer offloaded to CPU")
    assert rows["precision"] == "fp32" and rows["steps"] == "30 steps, 15.4k (15,360) tokens"
    assert rows["resume"] == "nothing to resume: starts from the beginning"


def test_auto_precision_says_what_the_nodes_pick(tmp_path: Path) -> None:
    local = training_summary(_plan(tmp_path, train={"precision": "auto"})).precision
    assert local["planned"] in ("fp32", "bf16") and local["why"].startswith("this machine: CPU")
    gpu = training_summary(_plan(tmp_path, site="a100-hdr", executor="slurm", job={"tasks_per_node": 4},
                                 train={"precision": "auto"})).precision
    assert gpu["planned"] == "bf16" and "GPUs" in gpu["why"]
    cpu = training_summary(_plan(tmp_path, site="local-slurm", executor="slurm",
                                 train={"precision": "auto"})).precision
    assert cpu["planned"] is None and "each rank decides" in cpu["why"]


def test_a_user_model_and_dataset(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("def model(cfg): ...\ndef data(cfg): ...\n")
    plan = _plan(tmp_path, train={"model": "mine.py:model"}, data={"source": "mine.py:data", "num_workers": 1})
    summary = training_summary(plan)
    assert summary.model == {"name": f"{tmp_path}/mine.py:model", "kind": "entry point", "parameters": None,
                             "seq_len": 128}
    rows = _rows(plan)
    assert "parameters not known on the login node" in rows["model"]
    assert rows["data"].startswith(f"your dataset {tmp_path}/mine.py:data") and rows["data"].endswith("1 loader worker")
    counted = training_summary(_plan(tmp_path, train={"model": "mine.py:model", "parameters": 124_000_000}))
    assert counted.model["parameters"] == 124_000_000


def test_programs_say_their_entry_point_args_and_params(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text("def main(ctx): ...\n")
    function = _plan(tmp_path, job={"program": "loop.py:main", "args": ["--fast"]}, params={"lr": 0.01})
    summary = training_summary(function)
    assert summary.kind == "program" and summary.program == {"entry_point": f"{tmp_path}/loop.py:main",
                                                             "kind": "function", "args": ["--fast"],
                                                             "params": {"lr": 0.01}}
    assert summary.model == {} and summary.checkpoint["every_steps"] == 50
    rows = _rows(function)
    assert rows["args"] == "--fast" and rows["params"] == "lr = 0.01" and "resume" in rows
    script = _plan(tmp_path, job={"program": "loop.py"})
    assert _rows(script)["checkpoints"] == "the script's own (ctx.checkpoint is for functions)"
    assert training_summary(_plan(tmp_path, job={"program": "smoke"})).kind == "smoke"


def test_a_run_folder_with_checkpoints_resumes_from_its_latest_verified_one(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    manager = CheckpointManager(Path(plan.run_dir) / "checkpoints", keep=3)
    for step in (10, 20):
        folder = manager.begin(step)
        (folder / "state.pt").write_bytes(b"x" * step)
        manager.commit(folder, {"world_size": 1, "layout": {"tensor": 1, "pipeline": 1, "data": 1, "context": 1},
                                "zero_stage": 2, "dtype": "fp32", "config_hash": "h"})
    resume = training_summary(plan).resume
    assert resume == {"enabled": True, "step": 20, "path": str(Path(plan.run_dir) / "checkpoints" / "step-00000020")}
    (Path(plan.run_dir) / "checkpoints" / "step-00000020" / "state.pt").write_bytes(b"short")  # damaged
    assert training_summary(plan).resume["step"] == 10
    assert _rows(plan)["resume"].startswith("from step 10 (")
    off = training_summary(_plan(tmp_path, checkpoint={"resume": False})).resume
    assert off == {"enabled": False, "step": None, "path": None}


def test_submit_and_validate_json_carry_the_training_section(tmp_path: Path) -> None:
    submit = subprocess.run([sys.executable, "-m", "hpc_train.submit", EXAMPLE, "--site", "local", "--dry-run",
                             "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    validate = subprocess.run([sys.executable, "-m", "hpc_train", "validate", EXAMPLE, "--site", "local", "--json"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    from_submit, from_validate = json.loads(submit.stdout)["training"], json.loads(validate.stdout)["training"]
    assert from_submit == from_validate and from_submit["model"]["name"] == "tiny"
    assert from_submit["steps"] == 200 and from_submit["resume"]["step"] is None
    plan = json.loads(validate.stdout)
    del plan["training"]
    assert Plan.from_json(json.dumps(plan)).name == "tiny-gpt"  # the rest is the plan as it was


def test_timed_checkpoints_show_the_interval_and_the_goodput_inside_the_job_and_through_the_queue(
        tmp_path: Path) -> None:
    plan = _plan(tmp_path, job={"nodes": 1, "tasks_per_node": 2}, checkpoint={"every_minutes": "auto"})
    cadence = training_summary(plan).checkpoint["cadence"]
    assert cadence["mode"] == "auto" and not cadence["cost_measured"]
    assert cadence["cost_s"] == 0.1  # the tiny model's guess, until the run times a save
    assert cadence["interval_s"] == pytest.approx((2 * 0.1 * 6300 * 3600) ** 0.5)
    assert cadence["goodput_in_place"] > cadence["goodput_requeue"]
    rows = _rows(plan)
    assert rows["checkpoints"].startswith("auto (Young/Daly), keep 3")
    assert "= sqrt(2 x 0.1 s x 6,300 h between failures); 0.1 s a save, estimated until the run times one" \
        in rows["cadence"]
    assert "through the queue (31 min a requeue)" in rows["cadence"]
    fixed = _rows(_plan(tmp_path, checkpoint={"every_minutes": 20}))
    assert fixed["checkpoints"].startswith("about every 20 min") and fixed["cadence"].startswith("20 min; ")
    assert "cadence" not in _rows(_plan(tmp_path))


def test_the_cadence_starts_from_the_save_time_an_earlier_attempt_measured(tmp_path: Path) -> None:
    from hpc_train.run.attempts import AttemptLog

    plan = _plan(tmp_path, checkpoint={"every_minutes": "auto"})
    Path(plan.run_dir).mkdir(parents=True)
    log = AttemptLog(Path(plan.run_dir))
    log.finish(log.begin("7", 0, "n1", 1.0, 0), outcome="preempted", end_step=40, save_s_max=4.5)
    cadence = training_summary(plan).checkpoint["cadence"]
    assert cadence["cost_measured"] and cadence["cost_s"] == 4.5
    assert "4.5 s a save, measured by this run" in _rows(plan)["cadence"]


def test_auto_needs_a_failure_rate_from_the_site(tmp_path: Path) -> None:
    from hpc_train.errors import ConfigError

    site = tmp_path / "site.toml"
    site.write_text('name = "nofail"\n[slurm]\nenabled = false\n[reliability]\nnode_mtbf_hours = 0\n')
    cfg = build(JobConfig, {"checkpoint": {"every_minutes": "auto"}})
    with pytest.raises(ConfigError, match=r"reliability\.node_mtbf_hours: 0\.0 leaves checkpoint\.every_minutes"):
        make_plan(cfg, load_site(str(site)), "local", cwd=tmp_path)
