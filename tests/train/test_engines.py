"""The engine seam: the engines there are, by name, and a name that is not one refused with the valid ones. The
DeepSpeed engine itself is exercised by every trainer test (it is the one the trainer builds)."""

from __future__ import annotations

import pytest

from hpc_train.errors import ConfigError
from hpc_train.train.engines import ENGINES, engine_kind
from hpc_train.train.trainer import ENGINE


def test_the_trainer_builds_a_known_engine() -> None:
    assert ENGINE in ENGINES and engine_kind(ENGINE).name == ENGINE == "deepspeed"
    kind = engine_kind("deepspeed")
    assert callable(kind.build) and callable(kind.checkpoints)


def test_an_unknown_engine_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as error:
        engine_kind("megatron")
    assert str(error.value).startswith('train.engine: "megatron" is not an engine. Fix: use one of: deepspeed')
