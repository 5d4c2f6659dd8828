"""Your own model (and data) in the real trainer, through ``hpc_train.submit`` on the local executor.

Two models from files: a language model built from hpc_train's tensor-parallel layers, on the trainer's own
synthetic tokens, and a small CNN classifier on its own tensor dataset with its own collate function. The
language model trains at ZeRO 0-3 on 2 data-parallel ranks, on 2 tensor-parallel ranks and on 2 pipeline
stages, and follows one rank (fp32, the same global batch: within 1e-5 at ZeRO-0, tensor and pipeline, 2e-5
at ZeRO 1-3, whose buckets sum in another order); its loss falls. The CNN trains at ZeRO 0 and 3 (a module
file, and partitions merged) and exports strictly loadable weights, batch-norm buffers included.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import exported

pytestmark = pytest.mark.slow
CODE = Path(__file__).parent / "user_code"
TOLERANCE = 1e-5
STEPS = 8


def _job(tmp_path: Path, model: str, source: str = "synthetic", collate: str = "") -> Path:
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nname = "own"\n[train]\nmodel = "{model}"\nsteps = {STEPS}\nseq_len = 32\n'
                   'precision = "fp32"\nlr = 1e-2\nwarmup_steps = 2\n'
                   f'[data]\nsource = "{source}"\nvocab_size = 64\ncollate = "{collate}"\n'
                   "[monitor]\nlog_every = 1\neval_every = 4\n[checkpoint]\nevery_steps = 0\n")
    return job


def _losses(tmp_path: Path, job: Path, *overrides: str) -> list[float]:
    sets = [arg for item in overrides for arg in ("--set", item)]
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(job), "--site", "local", *sets],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "own" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in record for record in records)
    return [record["loss"] for record in records if "loss" in record]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    work = tmp_path_factory.mktemp("one-rank")
    return _losses(work, _job(work, f"{CODE}/lm.py:model"), "job.tasks_per_node=1", "train.micro_batch=8",
                   "zero.stage=0")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_language_model_from_a_file_trains_at_every_zero_stage(tmp_path: Path, one_rank: list[float],
                                                                 stage: int) -> None:
    losses = _losses(tmp_path, _job(tmp_path, f"{CODE}/lm.py:model"), "job.tasks_per_node=2", "train.micro_batch=4",
                     f"zero.stage={stage}")
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses
    worst = max(abs(a - b) for a, b in zip(losses, one_rank, strict=True))
    limit = TOLERANCE if stage == 0 else 2 * TOLERANCE  # ZeRO 1-3 reduce in buckets: other sums, as for the GPT
    assert worst < limit, f"ZeRO-{stage}: max |2 ranks - 1 rank| = {worst:.2e}\n{losses}\n{one_rank}"


def test_tensor_parallel_layers_in_a_user_model_follow_one_rank(tmp_path: Path, one_rank: list[float]) -> None:
    losses = _losses(tmp_path, _job(tmp_path, f"{CODE}/lm.py:model"), "job.tasks_per_node=2", "parallel.tensor=2",
                     "train.micro_batch=8", "zero.stage=0")
    worst = max(abs(a - b) for a, b in zip(losses, one_rank, strict=True))
    assert worst < TOLERANCE, f"max |tp=2 - tp=1| = {worst:.2e}\n{losses}\n{one_rank}"


def test_a_user_model_as_pipeline_layers_on_two_stages_follows_one_rank(tmp_path: Path,
                                                                         one_rank: list[float]) -> None:
    """The factory returns ``pipeline_layers``: 2 stages of DeepSpeed's pipeline engine; its export is named as
    ``nn.Sequential(*layers)`` names it."""
    import torch

    losses = _losses(tmp_path, _job(tmp_path, f"{CODE}/lm.py:pipeline_model"), "job.tasks_per_node=2",
                     "parallel.pipeline=2", "train.micro_batch=8", "zero.stage=1")
    worst = max(abs(a - b) for a, b in zip(losses, one_rank, strict=True))
    assert worst < TOLERANCE, f"max |pp=2 - 1 rank| = {worst:.2e}\n{losses}\n{one_rank}"
    names = sorted(torch.load(exported(tmp_path / "runs" / "own", tmp_path / "pipeline.pt"), weights_only=True))
    assert names == ["0.weight", "1.block.down.bias", "1.block.down.weight", "1.block.up.bias", "1.block.up.weight",
                     "2.block.down.bias", "2.block.down.weight", "2.block.up.bias", "2.block.up.weight",
                     "3.head.weight", "3.norm.bias", "3.norm.weight"]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_cnn_on_its_own_dataset_trains_and_exports(tmp_path: Path, stage: int) -> None:
    """Its collate function makes each batch a dict, passed to the forward as keywords; the export loads
    strictly into the factory's module, its batch norm's buffers (one an integer count) included."""
    import torch

    from tests.rank.train.user_code import cnn

    losses = _losses(tmp_path, _job(tmp_path, f"{CODE}/cnn.py:model", f"{CODE}/cnn.py:dataset",
                                    f"{CODE}/cnn.py:as_dict"), "job.tasks_per_node=2", "train.micro_batch=16",
                     f"zero.stage={stage}")
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    model = json.loads((tmp_path / "runs" / "own" / "model.json").read_text())
    assert model["class"].endswith("SmallCNN") and "hf_config" not in model
    # export reads DeepSpeed's module file at ZeRO-0 and merges the partitions at ZeRO-3
    weights = torch.load(exported(tmp_path / "runs" / "own", tmp_path / "cnn.pt"), weights_only=True)
    assert weights["norm.num_batches_tracked"].dtype == torch.int64
    cnn.SmallCNN().load_state_dict(weights, strict=True)


@pytest.mark.parametrize(("model", "source", "says"), [
    ("broken.py:no_loss", "synthetic", "train.model {code}/broken.py:no_loss: the forward's loss is (4, 4), "
     "not a scalar tensor; reduce it (loss.mean())"),
    ("cnn.py:model", "broken.py:short", 'data.source {code}/broken.py:short: dataset(ctx, "train") returned a '
     "dataset of 3 samples, fewer than one global batch of 4"),
], ids=["forward-without-loss", "dataset-too-short"])
def test_a_user_model_or_dataset_that_cannot_train_fails_once_and_is_not_requeued(tmp_path: Path, model: str,
                                                                                  source: str, says: str) -> None:
    from tests.rank.program.test_runner_local import attempts, submit

    job = _job(tmp_path, f"{CODE}/{model}", source if source == "synthetic" else f"{CODE}/{source}")
    status, output = submit(tmp_path, str(job), "job.tasks_per_node=1")
    assert status == 1, output[-3000:]
    failed = [line for line in output.splitlines() if "failed: rank" in line]
    assert len(failed) == 1 and says.format(code=CODE) in failed[0], output[-3000:]
    runs = attempts(tmp_path / "runs" / "own")
    assert len(runs) == 1 and runs[0]["outcome"] == "failed" and not runs[0]["requeued"], runs
