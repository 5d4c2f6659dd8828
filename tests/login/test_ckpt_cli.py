"""``python -m hpc_train ckpt ls|verify|export`` on checkpoints of real tiny trainings (2 ranks, fp32): ZeRO-2,
ZeRO-3, a 2-stage pipeline and tensor = 2. Exports are checked against DeepSpeed's own fp32 module weights,
against each other and against the GPT they started from, so a wrong merge or a wrong name fails; safetensors
and bf16 exports against the pt one, and back into the GPT through ``load_exported``; bad input exits 2 and
writes nothing."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hpc_train.checkpoint import CheckpointManager
from hpc_train.login import main as hpc_main
from hpc_train.rank.train import load_exported
from hpc_train.rank.train.model import GPT, GPTConfig
from tests.conftest import REPO, CliResult, call_cli

pytestmark = pytest.mark.slow
BASE = {"train.steps": "4", "checkpoint.every_steps": "2", "train.precision": "fp32", "train.seq_len": "64",
        "monitor.eval_every": "0", "train.warmup_steps": "1"}
SEED = 1234  # examples/tiny_gpt.toml keeps the default train.seed
STEP2, STEP4 = "step-00000002", "step-00000004"


def _train(work: Path, **changes: str) -> Path:
    settings = {**BASE, **{key.replace("__", "."): value for key, value in changes.items()}}
    sets = [item for key, value in settings.items() for item in ("--set", f"{key}={value}")]
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                             "--site", "local", *sets], cwd=work, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return work / "runs" / "tiny-gpt"


@pytest.fixture(scope="module")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("zero2"))


@pytest.fixture(scope="module")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two steps, as the ZeRO-2 run's step-2 checkpoint: the same data, schedule and start.
    return _train(tmp_path_factory.mktemp("zero3"), zero__stage="3", train__steps="2")


@pytest.fixture(scope="module")
def tensor2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two steps on the ZeRO-2 run's data: one data-parallel rank with micro_batch 16 takes the 16 samples its two
    # ranks of 8 took, the mean loss over them is the same, and the layers start from the same full weights.
    return _train(tmp_path_factory.mktemp("tensor2"), parallel__tensor="2", train__steps="2",
                  train__micro_batch="16")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("pipe"), zero__stage="1", parallel__pipeline="2", train__steps="2")


def _ckpt(cwd: Path, *args: str) -> CliResult:
    return call_cli(hpc_main.main, ["ckpt", *args], cwd)


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    subprocess.run(["cp", "-a", str(run_dir), str(copy)], check=True)
    return copy


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _gpt() -> GPT:
    """The non-pipeline GPT the runs started from (same preset, vocabulary, length and seed)."""
    return GPT(GPTConfig.from_preset("tiny", vocab_size=256, seq_len=64), None, seed=SEED)


def _initial_weights() -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in _gpt().named_parameters()}


def _export(run: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    result = _ckpt(out.parent, "export", str(run), "--out", str(out), *extra)
    assert result.code == 0, result.err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    state = torch.load(out, weights_only=True)
    assert type(state) is dict
    return state


def _assert_gpt_shaped_and_trained(state: dict[str, torch.Tensor]) -> None:
    """GPT's names and shapes, fp32, moved from the start by a few Adam steps (lr 1e-3) and no more."""
    start = _initial_weights()
    assert sorted(state) == sorted(start)
    assert all(state[name].shape == start[name].shape and state[name].dtype == torch.float32 for name in start)
    moved = max(float((state[name] - start[name]).abs().max()) for name in start)
    assert 1e-5 < moved < 1e-2, moved  # a swapped shard or layer would move weights by ~0.1 or more
    _gpt().load_state_dict(state, strict=True)


def test_ls_lists_both_checkpoints_with_latest_and_resume(zero2: Path) -> None:
    result = _ckpt(zero2, "ls", str(zero2), "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert [row["folder"] for row in data["checkpoints"]] == [STEP2, STEP4]
    assert data["latest"] == data["resume"] == STEP4
    row = data["checkpoints"][1]
    assert row["latest"] and row["resume"] and row["verified"] and row["problem"] is None
    assert (row["world_size"], row["engine"], row["zero_stage"], row["dtype"]) == (2, "deepspeed", 2, "fp32")
    assert row["layout"] == {"tensor": 1, "pipeline": 1, "data": 2, "context": 1} and row["bytes"] > 0
    table = _ckpt(zero2, "ls", str(zero2 / "checkpoints"))
    assert table.code == 0 and STEP2 in table.out and "<- latest" in table.out and "<- resume" in table.out
    assert "DeepSpeed ZeRO-2" in table.out
    one = json.loads(_ckpt(zero2, "ls", str(zero2 / "checkpoints" / STEP2), "--json").out)
    assert [row["folder"] for row in one["checkpoints"]] == [STEP2] and one["resume"] == STEP4


def test_verify_passes_on_a_whole_run(zero2: Path) -> None:
    result = _ckpt(zero2, "verify", str(zero2), "--sha256")
    assert result.code == 0, result.out + result.err
    assert f"{STEP2}: ok" in result.out and f"{STEP4}: ok" in result.out
    assert f"resume would use {STEP4}" in result.out


def test_a_flipped_bit_fails_sha256_naming_the_file(zero2: Path, tmp_path: Path) -> None:
    run = _copy(zero2, tmp_path)
    shard = run / "checkpoints" / STEP4 / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip_a_bit(shard)
    assert _ckpt(tmp_path, "verify", str(run)).code == 0  # sizes still match
    result = _ckpt(tmp_path, "verify", str(run), "--sha256")
    assert result.code == 0, result.out  # resume falls back to step 2, which verifies
    assert f"{STEP4}: FAILED: state/zero_pp_rank_1_mp_rank_00_optim_states.pt is corrupt" in result.out
    assert f"resume would use {STEP2}" in result.out and 'checkpoint.verify = "size"' in result.out
    single = _ckpt(tmp_path, "verify", str(run / "checkpoints" / STEP4), "--sha256")
    assert single.code == 1 and "is corrupt" in single.out
    refused = _ckpt(tmp_path, "export", str(run / "checkpoints" / STEP4), "--out", str(tmp_path / "m.pt"))
    assert refused.code == 2 and "does not verify" in refused.err and "is corrupt" in refused.err
    refused = _ckpt(tmp_path, "export", str(run / "checkpoints" / STEP4), "--out", str(tmp_path / "m.safetensors"),
                    "--format", "safetensors")
    assert refused.code == 2 and "does not verify" in refused.err and "is corrupt" in refused.err
    fallback = _ckpt(tmp_path, "export", str(run), "--out", str(tmp_path / "fallback.pt"), "--json")
    assert fallback.code == 0 and json.loads(fallback.out)["step"] == 2, fallback.err
    _flip_a_bit(run / "checkpoints" / STEP2 / "rng" / "ranks-0-1.pt")
    none = _ckpt(tmp_path, "verify", str(run), "--sha256")
    assert none.code == 1 and f"{STEP2}: FAILED: rng/ranks-0-1.pt is corrupt" in none.out
    assert "no checkpoint verifies" in none.out
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "m.safetensors").exists()


def test_export_zero2_equals_deepspeeds_fp32_weights(zero2: Path, tmp_path: Path) -> None:
    state = _export(zero2, tmp_path / "model.pt")
    _assert_gpt_shaped_and_trained(state)
    # fp32 training: the module weights DeepSpeed saved are the master weights the export merged from shards
    module = torch.load(zero2 / "checkpoints" / STEP4 / "state" / "mp_rank_00_model_states.pt",
                        weights_only=True)["module"]
    assert all(torch.equal(state[name], module[name]) for name in module) and len(state) == len(module)
    again = _ckpt(tmp_path, "export", str(zero2), "--out", str(tmp_path / "model.pt"))
    assert again.code == 2 and "already exists" in again.err and "--force" in again.err
    forced = _ckpt(tmp_path, "export", str(zero2), "--out", str(tmp_path / "model.pt"), "--force", "--json")
    assert forced.code == 0 and json.loads(forced.out)["tensors"] == len(state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "model.pt.json"]  # no temporary file left


def test_export_reports_counts(zero2: Path, tmp_path: Path) -> None:
    result = _ckpt(tmp_path, "export", str(zero2 / "checkpoints" / STEP2), "--out", "m.pt", "--json")
    assert result.code == 0, result.err
    summary = json.loads(result.out)
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert summary["step"] == 2 and summary["tensors"] == len(state)
    assert summary["parameters"] == sum(t.numel() for t in state.values()) == 470_528
    assert summary["bytes"] == 4 * summary["parameters"]


def test_export_zero3_matches_zero2(zero2: Path, zero3: Path, tmp_path: Path) -> None:
    assert json.loads(_ckpt(zero3, "ls", str(zero3), "--json").out)["checkpoints"][0]["zero_stage"] == 3
    state = _export(zero3, tmp_path / "zero3.pt")
    _assert_gpt_shaped_and_trained(state)
    reference = _export(zero2 / "checkpoints" / STEP2, tmp_path / "zero2.pt")
    worst = max(float((state[name] - reference[name]).abs().max()) for name in reference)
    assert worst < 1e-4, worst  # the same two steps; only the order of reductions differs


def test_export_pipeline_renames_layers(pipeline: Path, tmp_path: Path) -> None:
    state = _export(pipeline, tmp_path / "pipe.pt")
    _assert_gpt_shaped_and_trained(state)
    assert list(state) == list(_initial_weights())  # in GPT's own order


def test_export_tensor_parallel_merges_to_what_tensor_1_exports(zero2: Path, tensor2: Path, tmp_path: Path) -> None:
    row = json.loads(_ckpt(tensor2, "ls", str(tensor2), "--json").out)["checkpoints"][0]
    assert row["layout"] == {"tensor": 2, "pipeline": 1, "data": 1, "context": 1} and row["zero_stage"] == 2
    state = _export(tensor2, tmp_path / "tp2.pt")
    _assert_gpt_shaped_and_trained(state)
    # Exactly each tensor rank's fp32 module weights DeepSpeed saved (fp32 training: the master weights the
    # per-rank consolidation merged), concatenated along the split dims model.json records.
    record = json.loads((tensor2 / "model.json").read_text())["tensor_parallel"]
    ranks = [torch.load(tensor2 / "checkpoints" / STEP2 / "state" / f"mp_rank_0{rank}_model_states.pt",
                        weights_only=True)["module"] for rank in (0, 1)]
    for name, value in state.items():
        dim = record["split_dims"].get(name)
        assert torch.equal(value, ranks[0][name] if dim is None else torch.cat([r[name] for r in ranks], dim)), name
    assert all(torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0] if name not in record["split_dims"])
    reference = _export(zero2 / "checkpoints" / STEP2, tmp_path / "tp1.pt")
    worst = max(float((state[name] - reference[name]).abs().max()) for name in reference)
    assert worst < 1e-4, worst  # the same two steps on the same data; only the order of reductions differs


def test_export_safetensors_loads_anywhere_and_into_the_gpt(zero2: Path, tmp_path: Path) -> None:
    reference = _export(zero2, tmp_path / "model.pt")
    out = tmp_path / "model.safetensors"
    result = _ckpt(tmp_path, "export", str(zero2), "--format", "safetensors", "--out", str(out), "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["format"] == "safetensors" and stat.S_IMODE(out.stat().st_mode) == 0o600
    state = load_file(str(out))
    assert sorted(state) == sorted(reference) and all(torch.equal(state[n], reference[n]) for n in reference)
    with safe_open(str(out), framework="pt") as handle:
        metadata = handle.metadata()
    assert (metadata["hpc_train.model"], metadata["hpc_train.step"], metadata["hpc_train.dtype"]) == ("tiny", "4",
                                                                                                     "fp32")
    assert json.loads(metadata["hpc_train.gpt_config"]) == {"vocab_size": 256, "seq_len": 64, "layers": 2,
                                                            "heads": 4, "hidden": 128}
    for path in (out, tmp_path / "model.pt"):  # the pt file through its sidecar model.pt.json
        model = load_exported(path)
        assert isinstance(model, GPT) and not model.training
        assert all(torch.equal(param, reference[name]) for name, param in model.named_parameters())
    again = _ckpt(tmp_path, "export", str(zero2), "--format", "safetensors", "--out", str(out))
    assert again.code == 2 and "already exists" in again.err and "--force" in again.err
    forced = _ckpt(tmp_path, "export", str(zero2), "--format", "safetensors", "--out", str(out), "--force")
    assert forced.code == 0, forced.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "model.pt.json", "model.safetensors"]


def test_export_bf16_casts_the_fp32_export(zero2: Path, tmp_path: Path) -> None:
    reference = _export(zero2, tmp_path / "fp32.pt")
    out = tmp_path / "bf16.safetensors"
    result = _ckpt(tmp_path, "export", str(zero2), "--format", "safetensors", "--dtype", "bf16", "--out", str(out),
                   "--json")
    assert result.code == 0, result.err
    summary = json.loads(result.out)
    assert summary["dtype"] == "bf16" and summary["bytes"] == 2 * summary["parameters"]
    state = load_file(str(out))
    assert sorted(state) == sorted(reference)
    assert all(state[n].dtype == torch.bfloat16 and torch.equal(state[n], reference[n].to(torch.bfloat16))
               for n in reference)
    model = load_exported(out)
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(tokens, tokens))


def _fake_checkpoint(root: Path, layout: dict[str, int], dtype: str = "fp32", zero: int = 1,
                     engine: str = "deepspeed") -> Path:
    """A committed checkpoint of placeholder files: enough for the refusals, which load nothing."""
    manager = CheckpointManager(root / "checkpoints", keep=2)
    tmp = manager.begin(2)
    shard = tmp / ("ranks/rank-0.pt" if engine == "program" else "state/mp_rank_00_model_states.pt")
    shard.parent.mkdir()
    shard.write_bytes(b"not a pickle")
    world = layout["tensor"] * layout["pipeline"] * layout["data"]
    return manager.commit(tmp, {"world_size": world, "layout": {**layout, "context": 1}, "zero_stage": zero,
                                "dtype": dtype, "config_hash": "x", "engine": engine})


# (case id, arguments with {t} for the test's folder, text the one message must contain)
BAD = [
    ("missing-path", ["ls", "{t}/nope"], "nope: does not exist. Fix: give a run folder"),
    ("not-a-run", ["verify", "{t}"], "is not a run folder, a checkpoints/ folder or a step folder"),
    ("a-file", ["ls", "{t}/run/checkpoints/latest"], "is a file, not a folder"),
    ("no-manifest", ["export", "{t}/bare", "--out", "m.pt"],
     "checkpoints: has 1 checkpoint(s), none verifies (sha256). Fix: python -m hpc_train ckpt verify"),
    ("no-checkpoints", ["export", "{t}/empty", "--out", "m.pt"], "empty/checkpoints: holds no checkpoints. Fix:"),
    ("out-folder-missing", ["export", "{t}/run", "--out", "no/m.pt"], "--out: the folder no does not exist"),
    ("out-exists", ["export", "{t}/run", "--out", "exists.pt"], "exists.pt already exists"),
    ("out-is-folder", ["export", "{t}/run", "--out", "run"], "--out: run is a folder"),
    ("tensor-parallel-no-record", ["export", "{t}/run", "--out", "m.safetensors", "--format", "safetensors"],
     "tensor 2 x pipeline 1 x data 1 x context 1, DeepSpeed ZeRO-1, fp32, and its run's model.json records no "
     "tensor-parallel split dims"),
    ("sidecar-exists", ["export", "{t}/run", "--out", "side.pt"], "side.pt.json already exists"),
    ("safetensors-exists", ["export", "{t}/run", "--out", "exists.pt", "--format", "safetensors"],
     "exists.pt already exists"),
    ("bad-format", ["export", "{t}/run", "--out", "m.pt", "--format", "onnx"], "invalid choice: 'onnx'"),
    ("bad-dtype", ["export", "{t}/run", "--out", "m.pt", "--dtype", "fp16"], "invalid choice: 'fp16'"),
    ("pipeline-bf16", ["export", "{t}/pipe", "--out", "m.pt"], 'export runs trained with train.precision = "fp32"'),
    ("no-out", ["export", "{t}/run"], "the following arguments are required: --out"),
    ("own-program", ["export", "{t}/prog", "--out", "m.pt"],
     "was written by your program through ctx.checkpoint, so it holds your objects by the names you saved them "
     "with, and export cannot tell which one is the model. Fix: load rank 0's copy yourself: torch.load('"),
]


@pytest.mark.parametrize(("argv", "message"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, argv: list[str], message: str) -> None:
    _fake_checkpoint(tmp_path / "run", {"tensor": 2, "pipeline": 1, "data": 1})
    _fake_checkpoint(tmp_path / "pipe", {"tensor": 1, "pipeline": 2, "data": 1}, dtype="bf16")
    _fake_checkpoint(tmp_path / "prog", {"tensor": 1, "pipeline": 1, "data": 2}, engine="program")
    (tmp_path / "bare" / "checkpoints" / STEP2).mkdir(parents=True)
    (tmp_path / "exists.pt").write_bytes(b"keep me")
    (tmp_path / "side.pt.json").write_bytes(b"keep me")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "plan.json").write_text("{}")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    result = _ckpt(tmp_path, *(arg.format(t=tmp_path) for arg in argv))
    assert result.code == 2, result.out + result.err
    assert message in result.err and "Traceback" not in result.err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "exists.pt").read_bytes() == b"keep me"


def test_ls_refuses_a_checkpoints_folder_others_can_write(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path / "run", {"tensor": 1, "pipeline": 1, "data": 1})
    os.chmod(tmp_path / "run" / "checkpoints", 0o770)  # noqa: S103 - the point of the test
    result = _ckpt(tmp_path, "ls", str(tmp_path / "run"))
    assert result.code == 2 and "is writable by others" in result.err
