"""The engine seam: the engines there are, by name, and a name that is not one refused with the valid ones. The
DeepSpeed engine itself is exercised by every trainer test (it is the one the trainer builds)."""

from __future__ import annotations

import pytest

from hpc_train.config.job import JobConfig
from hpc_train.errors import ConfigError
from hpc_train.rank.train.engines import ENGINES, engine_kind


def test_every_engine_the_config_takes_is_built_by_the_seam() -> None:
    choices = JobConfig.__dataclass_fields__["train"].default_factory().__dataclass_fields__["engine"].type
    assert sorted(ENGINES) == ["deepspeed", "fsdp2"] and all(name in str(choices) for name in ENGINES)
    for name in ENGINES:
        kind = engine_kind(name)
        assert kind.name == name and callable(kind.build) and callable(kind.checkpoints)


def test_an_unknown_engine_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as error:
        engine_kind("megatron")
    assert str(error.value).startswith('train.engine: "megatron" is not an engine. Fix: use one of: deepspeed, fsdp2')
