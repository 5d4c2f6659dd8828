"""The trainer's one model interface: the built-in GPT is the spec of every preset, and what the spec answers
(FLOPs per token, export names, memory plan parameters) is what the GPT modules say."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpc_train.config.job import MODEL_PRESETS, JobConfig
from hpc_train.config.loader import build
from hpc_train.rank.train.models import GPT_SPEC, model_spec
from tests.conftest import REPO


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_every_preset_is_the_gpt(preset: str) -> None:
    assert model_spec(preset) is GPT_SPEC and GPT_SPEC.name == "gpt"


def test_flops_per_token_is_6n_plus_attention_without_the_embeddings() -> None:
    """By hand for the 125M preset (h = 768, 12 layers, vocab 50304, untied head): a block holds 12h^2 + 13h
    parameters (qkv, proj, fc, proj with biases; two layer norms), so N = 12 x 7,087,872 + 2h (ln_f) + 50304h
    (head) = 123,689,472; 6N + 12LHT = 742,136,832 + 113,246,208."""
    config = build(JobConfig, {"train": {"model": "125M", "seq_len": 1024}, "data": {"vocab_size": 50304}})
    assert 12 * (12 * 768**2 + 13 * 768) + 2 * 768 + 50304 * 768 == 123_689_472
    assert GPT_SPEC.flops_per_token(config) == 855_383_040.0


def test_export_names_and_memory_parameters_come_from_the_spec() -> None:
    assert GPT_SPEC.parameter_name("1.attn.qkv.weight", 2) == "blocks.0.attn.qkv.weight"
    assert GPT_SPEC.parameter_name("3.head.weight", 2) == "head.weight"
    stages = GPT_SPEC.stage_parameters("tiny", 256, 64, 1, 2)
    assert len(stages) == 2 and stages[0][0].name == "wte.weight" and stages[1][-1].name == "head.weight"


def test_the_model_package_imports_no_torch() -> None:
    code = "import sys, hpc_train.rank.train.models, hpc_train.config.memory; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0


CODE = REPO / "tests" / "rank" / "train" / "user_code"


def _build(entry: str, pipeline: int = 1) -> object:
    """The user spec's build as a rank runs it, up to the seeding that needs the rank's groups."""
    from types import SimpleNamespace

    from hpc_train.common.topology import Topology

    ctx = SimpleNamespace(config=build(JobConfig, {}), params={})
    topology = Topology.build(2 * pipeline, pp=pipeline)
    return model_spec(entry).build(ctx, topology, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("function", "says"), [
    ("raises", "the factory raised ValueError: no weights for layer 3"),
    ("not_a_module", "the factory returned list, not a torch.nn.Module; return the model itself"),
])
def test_a_factory_that_raises_or_returns_no_module_is_named_in_one_line(function: str, says: str) -> None:
    from hpc_train.rank.runtime.entry_points import UserCodeError

    entry = f"{CODE}/broken.py:{function}"
    with pytest.raises(UserCodeError) as error:
        _build(entry)
    assert str(error.value).startswith(f"train.model {entry}: {says}")


def test_a_user_model_with_a_pipeline_is_refused_at_start_saying_what_works() -> None:
    from hpc_train.rank.runtime.entry_points import UserCodeError

    with pytest.raises(UserCodeError, match=r"parallel.pipeline > 1 needs the model as layers: return hpc_train\.rank"
                       r"\.train\.pipeline_layers\.pipeline_layers\(layers, loss_fn\) from the factory, or set"):
        _build(f"{CODE}/cnn.py:model", pipeline=2)


def test_a_factory_name_that_is_not_in_the_file_fails_before_anything_is_built() -> None:
    from hpc_train.rank.runtime.entry_points import UserCodeError

    with pytest.raises(UserCodeError, match=r"broken.py has no function rasies \(it has: .*raises"):
        model_spec(f"{CODE}/broken.py:rasies")


def test_user_model_flops_are_6n_unless_the_module_counts_its_own() -> None:
    import torch

    from hpc_train.rank.train.models.user import count_parameters

    config = build(JobConfig, {"train": {"seq_len": 64}})
    spec = model_spec(f"{CODE}/cnn.py:model")
    module = torch.nn.Linear(10, 10)  # 110 parameters
    assert count_parameters(module) == 110 and spec.flops_per_token(config, module) == 660.0
    module.flops_per_token = lambda seq_len: 7.0 * seq_len  # type: ignore[attr-defined]
    assert spec.flops_per_token(config, module) == 448.0
