"""``train.compile`` in the real trainer on the local executor, the tiny GPT in fp32 on 2 ranks: the blocks compile
into one graph with no graph break, FSDP2 and DeepSpeed compiled follow each other, and a compiled run's
checkpoint resumes eagerly (the weights' names are the eager model's) on the same losses.

The backend is ``aot_eager``: dynamo's trace and AOT autograd's forward and backward graphs, which is what
``train.compile`` adds to the run, without inductor's C++ kernels (29 s of compiling a rank on this 2-core
machine; measured by hand in docs/performance.md, where its losses equal the eager run's)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
STEPS = 20
ARGS = ["--site", "local", "--set", f"train.steps={STEPS}", "--set", "checkpoint.every_steps=10", "--set",
        "train.precision=fp32", "--set", "train.seq_len=32", "--set", "train.micro_batch=4", "--set",
        "monitor.log_every=1", "--set", "monitor.eval_every=0", "--set", "train.warmup_steps=2", "--set",
        "job.cpus_per_task=1", "--set", "job.tasks_per_node=2"]
COMPILED = ("train.compile=true", "train.compile_backend=aot_eager")
TOLERANCE = 1e-5


def _train(work: Path, *overrides: str) -> str:
    sets = [arg for item in overrides for arg in ("--set", item)]
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(REPO / "examples" / "tiny_gpt.toml"),
                             *ARGS, *sets], cwd=work, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout + result.stderr


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _run(root: Path, name: str, *overrides: str) -> SimpleNamespace:
    work = root / name
    work.mkdir()
    output = _train(work, *overrides)
    return SimpleNamespace(work=work, output=output, losses=_losses(work / "runs" / "tiny-gpt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("compile")
    return SimpleNamespace(fsdp2=_run(root, "fsdp2", "train.engine=fsdp2", *COMPILED),
                           deepspeed=_run(root, "deepspeed", *COMPILED))


def _apart(losses: dict[int, float], reference: dict[int, float], steps: range) -> list[tuple[int, float, float]]:
    return [(step, losses[step], reference[step]) for step in steps if abs(losses[step] - reference[step]) > TOLERANCE]


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_each_engine_compiles_the_blocks_into_one_graph_without_a_break(runs: SimpleNamespace, engine: str) -> None:
    output = getattr(runs, engine).output
    assert "compile: 2 block(s) compiled with torch.compile (backend aot_eager)" in output
    assert "dynamo made 1 graph(s) with 0 graph break(s)" in output, output[-3000:]


def test_fsdp2_and_deepspeed_compiled_follow_each_other(runs: SimpleNamespace) -> None:
    assert sorted(runs.fsdp2.losses) == list(range(1, STEPS + 1))
    assert not _apart(runs.fsdp2.losses, runs.deepspeed.losses, range(1, STEPS + 1))
    assert runs.fsdp2.losses[STEPS] < runs.fsdp2.losses[1] - 0.2  # it learns


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_a_compiled_run_s_checkpoint_resumes_eagerly_on_the_same_losses(runs: SimpleNamespace, tmp_path: Path,
                                                                       engine: str) -> None:
    """Compiling in place keeps every parameter's name, so an eager run loads the compiled run's step 10 strictly
    and its steps 11-20 are the compiled run's: the compiled graphs computed what eager Python computes."""
    trained = getattr(runs, engine)
    work = tmp_path / "copy"
    shutil.copytree(trained.work, work, symlinks=True)
    checkpoints = work / "runs" / "tiny-gpt" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000020")
    (checkpoints / "latest").write_text("step-00000010\n")
    output = _train(work, *(["train.engine=fsdp2"] if engine == "fsdp2" else []))
    assert "resumed from step 10" in output and "compile:" not in output
    assert not _apart(_losses(work / "runs" / "tiny-gpt"), trained.losses, range(11, STEPS + 1))
