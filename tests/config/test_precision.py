"""``train.precision = "auto"`` on the login node: the default, accepted everywhere, and planned for memory as
bf16 with GPUs and fp32 without; checks about fp16 apply to an explicit fp16 only."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.memory import assumed_precision, memory_plan
from hpc_train.config.memory_rows import memory_rows
from hpc_train.config.plan import make_plan
from hpc_train.config.sites import load_site
from hpc_train.errors import ConfigError


def _plan(tmp_path: Path, precision: str | None):
    train = {} if precision is None else {"precision": precision}
    return make_plan(build(JobConfig, {"train": train}), load_site("local"), "local", cwd=tmp_path)


def test_auto_is_the_default_and_passes_validation_on_a_cpu_site(tmp_path: Path) -> None:
    assert JobConfig().train.precision == "auto"
    plan = _plan(tmp_path, None)
    assert plan.config.train.precision == "auto"  # decided on the ranks, never here


def test_fp16_on_cpus_is_refused_only_when_asked_for(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='"fp16" needs a GPU'):
        _plan(tmp_path, "fp16")
    for precision in ("auto", "bf16", "fp32"):
        _plan(tmp_path, precision)


def test_auto_is_refused_in_no_other_spelling() -> None:
    with pytest.raises(ConfigError, match='did you mean "auto"'):
        build(JobConfig, {"train": {"precision": "atuo"}})


def test_memory_plans_auto_as_bf16_with_gpus_and_fp32_without_and_says_so() -> None:
    assert assumed_precision("fp16", 0) == ("fp16", "")
    with_gpus = memory_plan("tiny", 256, 64, 2, 1, 1, 2, 2, "auto", False, False, gpus_per_node=4)
    without = memory_plan("tiny", 256, 64, 2, 1, 1, 2, 2, "auto", False, False)
    assert with_gpus.precision == "bf16" and without.precision == "fp32"
    assert with_gpus.total == memory_plan("tiny", 256, 64, 2, 1, 1, 2, 2, "bf16", False, False).total
    assert without.total == memory_plan("tiny", 256, 64, 2, 1, 1, 2, 2, "fp32", False, False).total
    notes = [text for label, text in memory_rows(without) if label == "note"]
    assert any("planned as fp32 (the nodes have no GPUs" in note for note in notes)
    assert any("planned as bf16 (the nodes have GPUs" in note for note in with_gpus.notes)
