"""A ``ds_config.json``'s scheduler trains DeepSpeed's own schedule: for each of DeepSpeed's schedulers, the
learning rate of every step of a real DeepSpeed engine built by hpc_train (one gloo rank) equals that of
DeepSpeed's scheduler object stepped alone, with ``"auto"`` filled as the Hugging Face integration fills it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpc_train.config.deepspeed import deepspeed_config
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build

STEPS = 30
SCHEDULERS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    "WarmupDecayLR": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.1, "warmup_num_steps": 5,
                      "total_num_steps": "auto", "warmup_type": "linear"},
    "WarmupCosineLR": {"warmup_num_steps": 4, "total_num_steps": "auto", "warmup_min_ratio": 0.1,
                       "cos_min_ratio": 0.01},
    "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 8, "decay_lr_rate": 0.05,
                 "cycle_momentum": False},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 2.0},
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One process group for the module: DeepSpeed keeps the groups of the first engine for the process."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
            patch.setenv(name, value)  # what a launcher gives a rank, and DeepSpeed asks for
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        yield
        dist.destroy_process_group()


def _config(kind: str) -> JobConfig:
    return build(JobConfig, {"train": {"lr": 0.1, "steps": STEPS, "warmup_steps": 6, "precision": "fp32",
                                       "optimizer": "torch_adamw"},
                             "zero": {"stage": 0}, "deepspeed": {"scheduler": {"type": kind,
                                                                               "params": SCHEDULERS[kind]}}})


def _deepspeed_alone(config: JobConfig) -> list[float]:
    """DeepSpeed's scheduler object on an optimizer of its own, stepped as an engine steps it."""
    from deepspeed.runtime import lr_schedules

    scheduler = deepspeed_config(config, 1)["scheduler"]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.train.lr)
    made = getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"])
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        made.step()
    return rates


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_each_deepspeed_scheduler_trains_deepspeed_s_own_learning_rates(one_rank: None, tmp_path: Path,
                                                                         kind: str) -> None:
    from hpc_train.rank.train.engine import build_engine

    config = _config(kind)
    torch.manual_seed(0)
    engine = build_engine(torch.nn.Linear(4, 1), config, 1, None, None, local_rank=0)
    rates = []
    for _ in range(STEPS):
        rates.append(engine.optimizer.param_groups[0]["lr"])
        loss = engine(torch.ones(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert rates == _deepspeed_alone(config)
    assert len(set(rates)) > 3, rates  # a schedule, not a constant


def test_auto_is_filled_from_the_job_s_keys_as_the_hugging_face_integration_fills_it() -> None:
    ds = deepspeed_config(_config("WarmupLR"), 1)
    assert ds["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 6}
    assert ds["steps_per_print"] == 10**9  # hpc_train logs progress itself
    config = build(JobConfig, {"deepspeed": {"steps_per_print": 50, "zero_optimization": {
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}, "zero": {"stage": 3}})
    ds = deepspeed_config(config, 1, hidden_size=128)
    assert ds["steps_per_print"] == 50  # the user's own value wins
    zero = ds["zero_optimization"]
    assert (zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"]) == (14745, 1280)
    assert deepspeed_config(config, 1)["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"  # no model
