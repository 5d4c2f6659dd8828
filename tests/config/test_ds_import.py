"""A DeepSpeed user's ds_config.json as the job's config (``[train] deepspeed_config``): the keys hpc_train models
become typed keys, the rest pass through, a contradiction or a value the checks refuse names the key in the
file, and ``--set`` wins (a GPU file tried on CPUs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_train import __main__ as hpc_main
from hpc_train.config.ds_import import import_deepspeed_config
from hpc_train.config.plan import load_job
from hpc_train.errors import ConfigError
from tests.conftest import REPO, call_cli

SEED_FILE = REPO / "examples" / "hf_gpt2" / "ds_config.json"
CPU_TRIAL = ["--set", "train.precision=fp32", "--set", "zero.offload_optimizer=false", "--set",
             "train.optimizer=torch_adamw"]


def _job(folder: Path, extra: str = "", ds: dict[str, object] | None = None) -> Path:
    (folder / "ds_config.json").write_text(json.dumps(ds) if ds is not None else SEED_FILE.read_text())
    job = folder / "job.toml"
    job.write_text(f'[job]\nname = "ds"\ntasks_per_node = 2\n[train]\ndeepspeed_config = "ds_config.json"\n{extra}')
    return job


def test_the_seed_file_maps_onto_the_typed_config() -> None:
    imported = import_deepspeed_config(SEED_FILE, "ds_config.json")
    assert imported.typed == {"train.micro_batch": 8, "train.grad_accum": 1, "train.grad_clip": 1.0,
                              "zero.stage": 3, "zero.overlap_comm": True, "train.lr": 1e-3, "train.eps": 1e-8,
                              "train.weight_decay": 0.1, "train.beta1": 0.9, "train.beta2": 0.95,
                              "train.precision": "fp16", "zero.offload_optimizer": True,
                              "train.optimizer": "cpu_adam"}
    assert imported.origin["train.micro_batch"] == "ds_config.json: train_micro_batch_size_per_gpu"
    assert imported.passthrough == {"fp16": {"loss_scale": 0, "initial_scale_power": 16},
                                    "zero_optimization": {"stage3_max_live_parameters": 1e9},
                                    "wall_clock_breakdown": False}


def test_set_wins_over_the_file_and_the_rest_passes_through(tmp_path: Path) -> None:
    cfg = load_job(_job(tmp_path), CPU_TRIAL[1::2])
    assert (cfg.train.micro_batch, cfg.zero.stage, cfg.train.lr, cfg.train.beta2) == (8, 3, 1e-3, 0.95)
    assert (cfg.train.precision, cfg.zero.offload_optimizer, cfg.train.optimizer) == ("fp32", False, "torch_adamw")
    assert cfg.deepspeed["zero_optimization"] == {"stage3_max_live_parameters": 1e9}


@pytest.mark.parametrize(("extra", "ds", "says"), [
    ("micro_batch = 4\n", None, "ds_config.json: train_micro_batch_size_per_gpu: = 8 contradicts train.micro_batch = 4 "
     "in the job file"),
    ("", {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 24}, "ds_config.json: train_batch_size (as "
     "train.global_batch):"),
    ("", {"zero_optimization": {"stage": 3}}, ""),  # (valid: the stage alone; pipeline below refuses it)
    ("[parallel]\npipeline = 2\n", {"zero_optimization": {"stage": 3}},
     "ds_config.json: zero_optimization.stage (as zero.stage): ZeRO-3 cannot run with pipeline = 2"),
    ("", {"optimizer": {"type": "Lamb"}}, 'ds_config.json: optimizer.type: "Lamb" is not an optimizer'),
    ("", {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}},
     "ds_config.json: optimizer.params.torch_adam: is a setting of DeepSpeed's optimizer or scheduler"),
    ("", {"scheduler": {"type": "OneCycle"}}, 'ds_config.json: scheduler.type: "OneCycle" is not a schedule'),
    ("", None, 'ds_config.json: fp16.enabled (as train.precision): "fp16" needs a GPU'),
    ("[deepspeed]\nwall_clock_breakdown = true\n", {"wall_clock_breakdown": False},
     "ds_config.json: wall_clock_breakdown: contradicts deepspeed.wall_clock_breakdown in the job file"),
])
def test_a_contradicting_or_refused_file_exits_2_naming_its_key(tmp_path: Path, extra: str,
                                                                 ds: dict[str, object] | None, says: str) -> None:
    job = _job(tmp_path, extra, ds)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local"], tmp_path)
    if not says:
        assert result.code == 0, result.err
        return
    assert result.code == 2 and says in result.err, result.err
    assert result.err.count("error:") == 1 and "Traceback" not in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_key_given_with_set_is_no_contradiction(tmp_path: Path) -> None:
    job = _job(tmp_path, 'precision = "auto"\n')
    with pytest.raises(ConfigError, match=r"fp16\.enabled: = 'fp16' contradicts train\.precision = 'auto'"):
        load_job(job, [])
    assert load_job(job, ["train.precision=fp32"]).train.precision == "fp32"


def test_a_missing_or_broken_file_is_one_message(tmp_path: Path) -> None:
    job = _job(tmp_path)
    (tmp_path / "ds_config.json").unlink()
    with pytest.raises(ConfigError, match=r"train\.deepspeed_config: ds_config\.json does not exist"):
        load_job(job, [])
    (tmp_path / "ds_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"ds_config\.json: is not valid JSON"):
        load_job(job, [])


def test_the_plan_says_what_came_from_the_file(tmp_path: Path) -> None:
    job = _job(tmp_path)
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local", "--json", *CPU_TRIAL], tmp_path)
    assert result.code == 0, result.err
    training = json.loads(result.out)["training"]
    assert training["from_file"]["zero.stage"] == "ds_config.json: zero_optimization.stage"
    assert training["overridden"] == {"train.precision": "fp16", "zero.offload_optimizer": True,
                                      "train.optimizer": "cpu_adam"}
    assert training["engine"]["zero_stage"] == 3
