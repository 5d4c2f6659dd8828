"""TOML to typed config: unknown keys, wrong types and --set overrides."""

from __future__ import annotations

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.overrides import apply_overrides
from hpc_train.errors import ConfigError


def test_empty_file_gives_defaults_a_new_user_can_live_with() -> None:
    cfg = build(JobConfig, {})
    assert cfg.job.nodes == 1 and cfg.zero.stage == 2 and cfg.train.precision == "auto"


def test_unknown_key_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError) as error:
        build(JobConfig, {"job": {"taks_per_node": 2}})
    assert 'job.taks_per_node: unknown key, did you mean "tasks_per_node"?' in str(error.value)


def test_unknown_section_lists_valid_sections() -> None:
    with pytest.raises(ConfigError, match=r'trian: unknown section, did you mean "train"\?.*valid sections'):
        build(JobConfig, {"trian": {}})


def test_bool_is_not_an_int() -> None:
    with pytest.raises(ConfigError, match=r"job\.nodes: expected an integer, got True"):
        build(JobConfig, {"job": {"nodes": True}})


def test_int_is_accepted_for_a_float() -> None:
    assert build(JobConfig, {"train": {"lr": 1}}).train.lr == 1.0


def test_choice_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError, match='"bf61" is not valid, did you mean "bf16"'):
        build(JobConfig, {"train": {"precision": "bf61"}})


def test_env_values_become_strings() -> None:
    cfg = build(JobConfig, {"env": {"A": 1, "B": True, "C": "x"}})
    assert cfg.env == {"A": "1", "B": "1", "C": "x"}


def test_overrides_are_typed_like_the_file() -> None:
    data = apply_overrides({}, ["train.lr=1e-3", "job.time=02:00:00", "zero.offload_optimizer=true",
                                "job.forward_env=[\"HOME\"]", "env.X=a=b"], JobConfig)
    cfg = build(JobConfig, data)
    assert cfg.train.lr == 1e-3 and cfg.job.time == "02:00:00" and cfg.zero.offload_optimizer is True
    assert cfg.job.forward_env == ["HOME"] and cfg.env == {"X": "a=b"}


def test_override_value_of_wrong_type_names_key_and_type() -> None:
    with pytest.raises(ConfigError, match=r"job\.nodes: expected an integer, got 'two'"):
        build(JobConfig, apply_overrides({}, ["job.nodes=two"], JobConfig))


def test_override_later_wins() -> None:
    cfg = build(JobConfig, apply_overrides({"job": {"nodes": 1}}, ["job.nodes=2", "job.nodes=3"], JobConfig))
    assert cfg.job.nodes == 3
