"""``ckpt export`` without training: the tensor-parallel merge on plain tensors, the split dims the model card
records, each tensor rank's private view of a ZeRO folder, tensor x pipeline and ZeRO-0 checkpoints made of a
real GPT's shards, and ``load_exported`` on files that are not what it wants. The exports of real trainings
(ZeRO 2/3, pipeline, tensor = 2 against tensor = 1, safetensors, bf16) are in tests/login/test_ckpt_cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hpc_train.checkpoint import CheckpointManager
from hpc_train.checkpoint.export import _rank_view, merge_tensor_parallel, rank_files
from hpc_train.errors import ConfigError
from hpc_train.login import main as hpc_main
from hpc_train.rank.train import load_exported
from hpc_train.rank.train.model import GPT, GPTConfig
from hpc_train.rank.train.model_card import describe_model, split_dims
from tests.conftest import call_cli

CONFIG = GPTConfig.from_preset("tiny", vocab_size=256, seq_len=64)


def _full_state(seed: int = 7) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in GPT(CONFIG, None, seed=seed).state_dict().items()}


def _shard(state: dict[str, torch.Tensor], dims: dict[str, int], tensor: int) -> list[dict[str, torch.Tensor]]:
    """What each tensor rank holds: contiguous chunks along the split dim, the rest whole."""
    return [{name: value.chunk(tensor, dim=dims[name])[rank].clone() if name in dims else value.clone()
             for name, value in state.items()} for rank in range(tensor)]


def test_the_card_records_the_tensor_parallel_layers_split_dims() -> None:
    record = split_dims(GPT(CONFIG, None))
    dims = record["split_dims"]
    assert dims["wte.weight"] == 0 and dims["head.weight"] == 0
    assert dims["blocks.1.attn.qkv.weight"] == dims["blocks.1.attn.qkv.bias"] == dims["blocks.1.mlp.fc.bias"] == 0
    assert dims["blocks.0.attn.proj.weight"] == dims["blocks.0.mlp.proj.weight"] == 1
    assert "blocks.0.attn.proj.bias" not in dims and "wpe.weight" not in dims and "ln_f.weight" not in dims
    assert record["shapes"]["blocks.0.mlp.proj.weight"] == [128, 512] and record["unknown"] == []
    card = describe_model(GPT(CONFIG, None), "tiny")
    assert card["gpt_config"] == {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "hidden": 128}
    json.dumps(card)  # model.json is JSON


def test_a_marked_parameter_of_an_unknown_layer_is_recorded_as_unknown_unless_it_names_its_dim() -> None:
    model = nn.Linear(4, 6)
    model.weight.tensor_model_parallel = True  # what mark_sharded sets
    assert split_dims(model) == {"split_dims": {}, "shapes": {"bias": [6]}, "unknown": ["weight"]}
    model.weight.partition_dim = 1  # Megatron's attribute
    assert split_dims(model)["split_dims"] == {"weight": 1}


def test_a_pipelines_layers_are_walked_on_the_meta_device() -> None:
    from deepspeed.pipe import LayerSpec

    from hpc_train.rank.train.pipeline import EmbeddingStage, HeadStage

    class Pipe(nn.Module):  # what the card reads of DeepSpeed's PipelineModule: its layer specs
        def __init__(self) -> None:
            super().__init__()
            self._layer_specs = [LayerSpec(EmbeddingStage, CONFIG, None, 0), LayerSpec(HeadStage, CONFIG, None, 0)]

    card = describe_model(Pipe(), "tiny")
    assert card["tensor_parallel"]["split_dims"] == {"0.wte.weight": 0, "1.head.weight": 0}
    assert card["gpt_config"]["vocab_size"] == 256


def test_merge_rebuilds_the_full_tensors() -> None:
    full = _full_state()
    record = split_dims(GPT(CONFIG, None))
    for tensor in (2, 4):
        merged = merge_tensor_parallel(_shard(full, record["split_dims"], tensor), record["split_dims"],
                                       record["shapes"], "here")
        assert list(merged) == list(full) and all(torch.equal(merged[n], full[n]) for n in full)


@pytest.mark.parametrize("case", ["missing-name", "odd-shape", "wrong-dim", "replicated-differs"])
def test_merge_refuses_shards_that_do_not_fit(case: str) -> None:
    full = _full_state()
    record = split_dims(GPT(CONFIG, None))
    dims, shapes = dict(record["split_dims"]), record["shapes"]
    shards = _shard(full, dims, 2)
    if case == "missing-name":
        del shards[1]["head.weight"]
    elif case == "odd-shape":
        shards[1]["blocks.0.mlp.fc.weight"] = shards[1]["blocks.0.mlp.fc.weight"][:-1]
    elif case == "wrong-dim":
        dims["blocks.0.mlp.fc.weight"] = 1
    else:
        shards[1]["ln_f.weight"] = torch.ones(7)
    with pytest.raises(ConfigError) as caught:
        merge_tensor_parallel(shards, dims, shapes, "runs/x/checkpoints/step-00000002")
    assert str(caught.value).startswith("runs/x/checkpoints/step-00000002: ") and "Fix: " in str(caught.value)


def test_each_tensor_rank_gets_a_private_folder_of_its_own_files(tmp_path: Path) -> None:
    names = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
             "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    for name in names:
        (tmp_path / name).write_bytes(name.encode())
    ranks = rank_files(tmp_path)
    assert sorted(ranks) == [0, 1]
    for rank, files in ranks.items():
        with _rank_view(files) as view:
            assert (view.stat().st_mode & 0o777, view.parent.stat().st_mode & 0o777) == (0o700, 0o700)
            inside = sorted(p.name for p in view.iterdir())
            assert inside == sorted(n for n in names if f"mp_rank_0{rank}_" in n)
            assert all((view / n).read_bytes() == n.encode() for n in inside)
        assert not view.exists()


def _fake_run(root: Path, layout: dict[str, int], files: dict[str, Any], card: dict[str, Any]) -> Path:
    """A committed step-2 checkpoint of ``files`` (name -> object for torch.save) with ``model.json``."""
    root.mkdir(parents=True)
    (root / "model.json").write_text(json.dumps(card))
    manager = CheckpointManager(root / "checkpoints", keep=2)
    tmp = manager.begin(2)
    (tmp / "state").mkdir()
    for name, value in files.items():
        torch.save(value, tmp / "state" / name)
    world = layout["tensor"] * layout["pipeline"]
    manager.commit(tmp, {"world_size": world, "layout": {"tensor": layout["tensor"], "pipeline": layout["pipeline"],
                                                         "data": 1, "context": 1},
                         "zero_stage": layout.get("zero", 1), "dtype": "fp32", "config_hash": "x"})
    return root


def _pipeline_layers(seed: int) -> list[nn.Module]:
    from hpc_train.rank.train.model import Block
    from hpc_train.rank.train.pipeline import EmbeddingStage, HeadStage

    return [EmbeddingStage(CONFIG, None, seed), *(Block(CONFIG, None, seed + 100 * (i + 1))
                                                  for i in range(CONFIG.layers)), HeadStage(CONFIG, None, seed)]


def _export_ok(run: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    result = call_cli(hpc_main.main, ["ckpt", "export", str(run), "--out", str(out), *extra], run.parent)
    assert result.code == 0, result.err
    return load_file(str(out)) if out.suffix == ".safetensors" else torch.load(out, weights_only=True)


def test_a_tensor_x_pipeline_checkpoint_merges_to_the_gpt(tmp_path: Path) -> None:
    from deepspeed.pipe import LayerSpec

    layers = _pipeline_layers(seed=3)

    class Pipe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._layer_specs = [LayerSpec(type(layer), CONFIG, None, 0) for layer in layers]

    card = describe_model(Pipe(), "tiny")
    dims = card["tensor_parallel"]["split_dims"]
    files = {}
    for index, layer in enumerate(layers):
        state = {f"{index}.{name}": value for name, value in layer.state_dict().items()}
        for rank, shard in enumerate(_shard(state, dims, 2)):
            files[f"layer_{index:02d}-model_{rank:02d}-model_states.pt"] = {
                name.partition(".")[2]: value for name, value in shard.items()}
    run = _fake_run(tmp_path / "run", {"tensor": 2, "pipeline": 2}, files, card)
    state = _export_ok(run, tmp_path / "m.safetensors", "--format", "safetensors")
    expected = _full_state(seed=3)
    assert sorted(state) == sorted(expected) and all(torch.equal(state[n], expected[n]) for n in expected)
    model = load_exported(tmp_path / "m.safetensors")
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def test_a_zero0_tensor_parallel_checkpoint_merges_to_the_gpt(tmp_path: Path) -> None:
    card = describe_model(GPT(CONFIG, None), "tiny")
    full = _full_state(seed=5)
    shards = _shard(full, card["tensor_parallel"]["split_dims"], 2)
    files = {f"mp_rank_{rank:02d}_model_states.pt": {"module": shard} for rank, shard in enumerate(shards)}
    run = _fake_run(tmp_path / "run", {"tensor": 2, "pipeline": 1, "zero": 0}, files, card)
    state = _export_ok(run, tmp_path / "m.pt", "--dtype", "bf16")
    assert all(torch.equal(state[n], full[n].to(torch.bfloat16)) for n in full) and len(state) == len(full)
    model = load_exported(tmp_path / "m.pt")
    assert not model.training and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    del card["tensor_parallel"]["split_dims"]["head.weight"]  # as if the card took it for a whole tensor
    (run / "model.json").write_text(json.dumps(card))
    refused = call_cli(hpc_main.main, ["ckpt", "export", str(run), "--out", str(tmp_path / "n.pt")], tmp_path)
    assert refused.code == 2 and "Traceback" not in refused.err and not (tmp_path / "n.pt").exists()
    assert "the shards of head.weight concatenate to [128, 128], model.json records [256, 128]" in refused.err
    (run / "model.json").write_text(json.dumps({**card, "tensor_parallel": {"error": "TypeError: odd layer"}}))
    refused = call_cli(hpc_main.main, ["ckpt", "export", str(run), "--out", str(tmp_path / "n.pt")], tmp_path)
    assert refused.code == 2 and "rank 0 could not record the split dims in its run's model.json (TypeError: odd " \
        "layer). Fix: train it one more step" in refused.err


def test_a_card_that_cannot_walk_the_model_records_why() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._layer_specs = ["not a layer"]

    assert describe_model(Odd(), "m.py:odd")["tensor_parallel"] == {
        "error": "TypeError: pipeline layer 0 is a str, not a module or a LayerSpec"}


def _description(**changes: str) -> dict[str, str]:
    description = {"format": "pt", "hpc_train.export": "1", "hpc_train.model": "tiny", "hpc_train.dtype": "fp32",
                   "hpc_train.step": "2", "hpc_train.gpt_config": json.dumps(
                       {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "hidden": 128})}
    return {key: value for key, value in {**description, **changes}.items() if value}


BAD_FILES = {
    "not-a-file": ("missing.safetensors", None, "does not exist"),
    "no-metadata": ("plain.safetensors", {}, "is not an hpc_train export"),
    "user-model": ("user.safetensors", _description(**{"hpc_train.model": "m.py:build", "hpc_train.gpt_config": ""}),
                   "not of the built-in GPT"),
    "pt-no-sidecar": ("lonely.pt", None, "has no lonely.pt.json beside it"),
    "wrong-shapes": ("small.safetensors", _description(**{"hpc_train.gpt_config": json.dumps(
        {"vocab_size": 512, "seq_len": 64, "layers": 2, "heads": 4, "hidden": 128})}), "does not fit the GPT"),
    "garbage": ("junk.safetensors", None, "is not"),
}


@pytest.mark.parametrize(("name", "metadata", "message"), BAD_FILES.values(), ids=BAD_FILES.keys())
def test_load_exported_names_the_file_and_the_fix(tmp_path: Path, name: str, metadata: dict[str, str] | None,
                                                  message: str) -> None:
    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save(_full_state(), path)
    elif metadata is not None:
        save_file(_full_state(), str(path), metadata=metadata)
    elif name.startswith("junk"):
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ConfigError) as caught:
        load_exported(path)
    assert str(caught.value).startswith(str(path)) and message in str(caught.value) and "Fix: " in str(caught.value)


def test_load_exported_rebuilds_the_gpt_in_eval_mode(tmp_path: Path) -> None:
    full = _full_state(seed=11)
    save_file(full, str(tmp_path / "m.safetensors"), metadata=_description())
    model = load_exported(tmp_path / "m.safetensors")
    assert isinstance(model, GPT) and not model.training
    assert all(torch.equal(p, full[n]) for n, p in model.named_parameters())
    tokens = torch.randint(0, 256, (2, 16))
    reference = GPT(CONFIG, None, seed=11).eval()
    assert torch.allclose(model(tokens, tokens), reference(tokens, tokens))
