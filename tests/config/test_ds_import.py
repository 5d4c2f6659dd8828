"""A DeepSpeed user's ds_config.json as the job's config (``[train] deepspeed_config``): the keys hpc_train models
become typed keys, the rest pass through, a contradiction or a value the checks refuse names the key in the
file, and ``--set`` wins (a GPU file tried on CPUs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpc_train.config.ds_import import import_deepspeed_config
from hpc_train.config.plan import load_job
from hpc_train.errors import ConfigError
from hpc_train.login import main as hpc_main
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
     "ds_config.json: optimizer.params.torch_adam: is a setting of DeepSpeed's optimizer, which hpc_train builds"),
    ("", {"scheduler": {"type": "Cosine"}}, 'ds_config.json: scheduler.type: "Cosine" is not one of DeepSpeed\'s '
     "schedulers. Fix: use one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    ("", {"scheduler": {"params": {"warmup_num_steps": 5}}}, 'scheduler.type: "None" is not one of'),
    ("", {"scheduler": {"type": [0.9, 0.95, 0.99]}}, 'scheduler.type: "[0.9, 0.95, 0.99]" is not one of'),
    ("", {"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 5}}},
     "ds_config.json: scheduler.params.total_num_steps: is not a parameter of DeepSpeed's WarmupLR. Fix: its "
     "parameters: warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration"),
    ("", {"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": "auto"}}},
     'ds_config.json: scheduler.params.cycle_max_lr: "auto" has no value to take here'),
    ("", {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}},
     'ds_config.json: zero_optimization.sub_group_size: "auto" has no value to take here'),
    ("", {"scheduler": {"type": "OneCycle"}, "steps_per_print": 10, "wall_clock_breakdown": True}, ""),
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


@pytest.mark.parametrize(("ds", "says"), [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "ds_config.json: fp16.enabled and bf16.enabled: are both true; DeepSpeed refuses more than one number format"),
    ({"bfloat16": {"enabled": True}, "amp": {"enabled": True}}, "ds_config.json: bf16.enabled and amp.enabled"),
    ({"fp16": {"enabled": "yes"}}, "ds_config.json: fp16.enabled: is 'yes', not true or false"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95, 0.99]}}},
     "ds_config.json: optimizer.params.betas: is [0.9, 0.95, 0.99], not two numbers in [0, 1)"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, "ds_config.json: optimizer.params.eps: 0 is outside"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "ds_config.json: optimizer.params.lr: -1 is outside"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}}, "optimizer.params.weight_decay: -0.1"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "optimizer.params.lr: is 'fast', not a number"),
    ({"fp16": {"enabled": True, "initial_scale_power": 5000}}, "fp16.initial_scale_power: 5000 is outside"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.device: is 'nvme'; hpc_train offloads to the CPU only"),
    ({"optimizer": "AdamW"}, "ds_config.json: optimizer: is 'AdamW', not a section"),
    ({"train_micro_batch_size_per_gpu": 2**62}, "train_micro_batch_size_per_gpu (as train.micro_batch): "
     "4611686018427387904 is above the maximum"),
])
def test_what_deepspeed_refuses_is_refused_at_validate_naming_file_and_key(tmp_path: Path, ds: dict[str, object],
                                                                           says: str) -> None:
    job = _job(tmp_path, "", ds)
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local"], tmp_path)
    assert result.code == 2 and says in result.err, result.err
    assert result.err.count("error:") == 1 and "Traceback" not in result.err


@pytest.mark.parametrize(("text", "says"), [
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "ds_config.json: nests deeper than 32 levels"),
    ('{"a": ' + '{"b": ' * 40 + "1" + "}" * 41, "ds_config.json: nests deeper than 32 levels"),
    ('{"a": NaN}', "ds_config.json: is not valid JSON (NaN is not a JSON number)"),
    ('{"a": -Infinity}', "is not valid JSON (-Infinity is not a JSON number)"),
    ('{"a": ' + "7" * 5000 + "}", "ds_config.json: is not valid JSON (holds an integer of thousands of digits)"),
    ('{"a": 1e999}', "ds_config.json: a: inf is not a finite number"),
    ('{"\\u00e9t\\u00e9": 1}', "is not plain ASCII"),
    ('{"a": "x\\u001b[2J"}', "ds_config.json: a: holds the control character"),
])
def test_a_file_no_reader_should_take_is_one_message(tmp_path: Path, text: str, says: str) -> None:
    job = _job(tmp_path, "", {})
    (tmp_path / "ds_config.json").write_text(text)
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local"], tmp_path)
    assert result.code == 2 and says in result.err, result.err


def test_a_fifo_as_the_file_is_refused_unread(tmp_path: Path) -> None:
    job = _job(tmp_path, "", {})
    (tmp_path / "ds_config.json").unlink()
    os.mkfifo(tmp_path / "ds_config.json")
    with pytest.raises(ConfigError, match="is not a JSON file of at most 1 MiB"):
        load_job(job, [])


def test_the_deepspeed_table_is_checked_as_the_file_is(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("[deepspeed]\namp = { enabled = true }\n[train]\nprecision = \"bf16\"\n")
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local"], tmp_path)
    assert result.code == 2 and "deepspeed.bf16.enabled and amp.enabled: are both true" in result.err, result.err


def _plan(tmp_path: Path, job: Path, extra: list[str]) -> dict[str, object]:
    result = call_cli(hpc_main.main, ["submit", str(job), "--dry-run", "--json", "--executor", "local", *extra],
                      tmp_path)
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_set_deepspeed_config_is_applied_exactly_as_the_job_file_key(tmp_path: Path) -> None:
    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.9]}}, "wall_clock_breakdown": True}
    in_file = _job(tmp_path, "", ds)
    bare = tmp_path / "bare.toml"
    bare.write_text('[job]\nname = "ds"\ntasks_per_node = 2\n')
    by_file = _plan(tmp_path, in_file, [])
    by_set = _plan(tmp_path, bare, ["--set", "train.deepspeed_config=ds_config.json"])
    assert by_set == by_file
    config = by_set["plan"]["config"]
    assert (config["zero"]["stage"], config["train"]["micro_batch"], config["train"]["lr"]) == (3, 3, 2e-3)
    assert config["deepspeed"] == {"wall_clock_breakdown": True}
    assert by_set["training"]["from_file"]["zero.stage"] == "ds_config.json: zero_optimization.stage"


def test_set_of_a_key_the_file_also_sets_is_named_as_the_command_line_s(tmp_path: Path) -> None:
    job = _job(tmp_path, "", {"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError) as caught:
        load_job(job, ["zero.stage=7"])
    assert caught.value.where == "zero.stage"


def test_two_peaks_that_disagree_are_refused(tmp_path: Path) -> None:
    """Fuzzer finding (seed 13, case 11759): optimizer.params.lr and scheduler.params.warmup_max_lr both name
    train.lr; the last one read won silently."""
    job = _job(tmp_path, "", {"optimizer": {"params": {"lr": 0.5}}, "scheduler": {"params": {"warmup_max_lr": 1}}})
    with pytest.raises(ConfigError, match=r"warmup_max_lr: = 1 and optimizer\.params\.lr = 0\.5 both give"):
        load_job(job, [])


def test_a_run_root_name_longer_than_a_file_system_takes_is_refused(tmp_path: Path) -> None:
    """Fuzzer finding (seed 13, case 16515): a 400-character folder name ended in OSError ENAMETOOLONG."""
    job = tmp_path / "job.toml"
    job.write_text("")
    result = call_cli(hpc_main.main, ["validate", str(job), "--set", "job.run_root=" + "1" * 400], tmp_path)
    assert result.code == 2 and "job.run_root: has a name of 400 characters" in result.err, result.err


def test_what_deepspeed_takes_is_taken_bf16_beside_its_old_name_and_a_zero_min_loss_scale() -> None:
    """Found by review: DeepSpeed reads bf16 and ignores bfloat16 when a file has both, and takes a
    min_loss_scale of 0; neither is refused."""
    from hpc_train.config.ds_semantics import check_semantics

    data = check_semantics({"bf16": {"enabled": False}, "bfloat16": {"enabled": True},
                            "fp16": {"enabled": True, "min_loss_scale": 0}}, "ds_config.json")
    assert "bfloat16" not in data and data["bf16"] == {"enabled": False}


def test_set_of_a_scheduler_s_typed_key_reaches_deepspeed_s_scheduler(tmp_path: Path) -> None:
    """A WarmupLR's peak and warm-up are read into train.lr and train.warmup_steps; --set of those (a sweep of
    the learning rate) changes what DeepSpeed's scheduler gets, as --set wins over the file everywhere."""
    from hpc_train.config.deepspeed import deepspeed_config

    job = _job(tmp_path, "", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4,
                                                                           "warmup_num_steps": 20}}})
    assert deepspeed_config(load_job(job, []), 1)["scheduler"]["params"] == {"warmup_max_lr": 3e-4,
                                                                              "warmup_num_steps": 20}
    changed = load_job(job, ["train.lr=1e-3", "train.warmup_steps=50"])
    assert deepspeed_config(changed, 1)["scheduler"]["params"] == {"warmup_max_lr": 1e-3, "warmup_num_steps": 50}


def test_a_scheduler_in_the_job_s_deepspeed_table_is_checked_as_the_file_s(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[deepspeed.scheduler]\ntype = "WarmupLR"\n[deepspeed.scheduler.params]\ncycle_min_lr = 0.1\n')
    result = call_cli(hpc_main.main, ["validate", str(job), "--site", "local"], tmp_path)
    assert result.code == 2 and "deepspeed.scheduler.params.cycle_min_lr: is not a parameter of DeepSpeed's " \
                                "WarmupLR" in result.err, result.err


def test_deepspeed_s_tag_check_is_off_unless_the_file_asks_for_it(tmp_path: Path) -> None:
    """hpc_train names every DeepSpeed checkpoint with one tag on every rank: DeepSpeed's check that the ranks
    agree on it (two all-reduces in each save call) is left out, unless the user's file sets it."""
    from hpc_train.config.deepspeed import deepspeed_config

    plain = load_job(_job(tmp_path, "", {"train_micro_batch_size_per_gpu": 2}), [])
    assert deepspeed_config(plain, 2)["checkpoint"] == {"tag_validation": "Ignore"}
    theirs = load_job(_job(tmp_path, "", {"checkpoint": {"tag_validation": "Fail", "use_node_local_storage": False}}),
                      [])
    assert deepspeed_config(theirs, 2)["checkpoint"] == {"tag_validation": "Fail", "use_node_local_storage": False}
