"""The Hugging Face GPT-2 example (``examples/hf_gpt2``) in the real trainer on the local executor: ZeRO-2 on 2
ranks, 2 DataLoader workers per rank, preempted with USR2 at random steps. The exported weights are bitwise
those of an uninterrupted run; they load into ``GPT2LMHeadModel`` with ``strict=True``, and the ``--format hf``
folder loads with ``from_pretrained``, both giving the trained module's logits. After a resume on another
data-parallel size the data position is exact: the next step sees the samples the uninterrupted run saw."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpc_train.run.node_log import rank_log_text
from hpc_train.run.watch import local_rank_pid
from tests.conftest import REPO, exported
from tests.rank.train.signals import attempts as _attempts
from tests.rank.train.signals import running as _running
from tests.rank.train.signals import signal_at_steps, two_signal_steps

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install 'hpc_train[hf]') is missing")
pytestmark = pytest.mark.slow
EXAMPLE = REPO / "examples" / "hf_gpt2"
STEPS = 24
ARGS = ["--site", "local", "--set", f"train.steps={STEPS}", "--set", "train.precision=fp32", "--set",
        "monitor.log_every=1", "--set", "monitor.eval_every=8", "--set", "checkpoint.every_steps=100", "--set",
        "data.num_workers=2", "--set", "data.persistent_workers=true", "--set", "train.warmup_steps=2"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.u16"
    subprocess.run([sys.executable, "-m", "hpc_train.login.prepare", str(REPO / "examples" / "corpus" /
                    "hpc_train_docs.txt"), str(path)], check=True, capture_output=True, timeout=60)
    return path


def _submit(cwd: Path, tokens: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpc_train.submit", str(EXAMPLE / "job.toml"), *ARGS, "--set",
                             f"data.path={tokens}", *extra], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finished(process: subprocess.Popen[str]) -> None:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tokens: Path) -> SimpleNamespace:
    work = tmp_path_factory.mktemp("plain")
    _finished(_submit(work, tokens))
    run_dir = work / "runs" / "hf-gpt2"
    weights = torch.load(exported(run_dir, work / "weights.pt"), weights_only=True)
    return SimpleNamespace(weights=weights, losses=_losses(run_dir))


def _gpt2(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The example's factory, as the ranks built it, with ``weights`` loaded strictly."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import gpt2
    finally:
        sys.path.remove(str(EXAMPLE))
    ctx = SimpleNamespace(params={"hidden": 64, "layers": 2, "heads": 4},
                          config=SimpleNamespace(train=SimpleNamespace(seq_len=64)))
    module = gpt2.model(ctx)
    module.load_state_dict(weights, strict=True)
    return module.eval()


def test_preempted_at_random_steps_it_exports_the_uninterrupted_weights_loadable_by_transformers(
        uninterrupted: SimpleNamespace, tokens: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "hf-gpt2"
    seed = int(time.time())  # printed on failure: the steps are reproducible
    plan = two_signal_steps(seed, STEPS)
    process = _submit(tmp_path, tokens)
    try:
        signal_at_steps(process, run_dir, plan)
        _finished(process)
    finally:
        if process.poll() is None:
            process.kill()
    attempts = _attempts(run_dir)
    assert [a["outcome"] for a in attempts] == ["preempted", "preempted", "completed"], (seed, plan, attempts)
    weights = torch.load(exported(run_dir, tmp_path / "weights.pt"), weights_only=True)
    assert weights.keys() == uninterrupted.weights.keys()
    different = [name for name, tensor in uninterrupted.weights.items() if not torch.equal(weights[name], tensor)]
    assert not different, f"{different[:3]} differ after preemptions at {plan} (seed {seed})"
    assert _losses(run_dir) == uninterrupted.losses
    trained = _gpt2(weights)  # strict=True: every name of the module, nothing else
    folder = exported(run_dir, tmp_path / "gpt2-hf", "--format", "hf")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    inputs = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(inputs).logits, trained(inputs).logits)


def test_stopped_without_requeue_and_resumed_on_another_data_parallel_size_the_next_step_sees_the_same_samples(
        uninterrupted: SimpleNamespace, tokens: Path, tmp_path: Path) -> None:
    """USR2 with ``preempt.requeue = false``: the run saves, exits 75 and says how to resume. Run again on 1 rank
    with micro batch 16 (2 x 8 before: the same global batch), its first step sees the samples the uninterrupted
    run saw at that step, so its loss is the same up to the order of the sums."""
    run_dir = tmp_path / "runs" / "hf-gpt2"
    process = _submit(tmp_path, tokens, "--set", "preempt.requeue=false")
    try:
        deadline = time.monotonic() + 180
        while not _running(run_dir, attempt=1, past=5):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(local_rank_pid(run_dir, 1), signal.SIGUSR2)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    (first,) = _attempts(run_dir)
    end = first["end_step"]
    assert first["outcome"] == "preempted" and not first["requeued"], first
    assert first["note"].startswith("preempt.requeue is false") and first["signal"] == "SIGUSR2"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{end:08d}"
    assert process.returncode != 0 and f"stopped after SIGUSR2 and saved step {end}" in output, output[-3000:]
    assert "Run the same command again to resume" in output
    assert f"stopped after step {end} on SIGUSR2" in rank_log_text(run_dir, 0)
    _finished(_submit(tmp_path, tokens, "--set", "train.micro_batch=16", "--set", "job.tasks_per_node=1"))
    second = _attempts(run_dir)[-1]
    assert second["start_step"] == end and second["end_step"] == STEPS, second
    assert json.loads((run_dir / "train.json").read_text())["sampler"] == {"epoch": 0, "offset": STEPS * 16}
    resumed = _losses(run_dir)[end + 1]
    assert abs(resumed - uninterrupted.losses[end + 1]) < 1e-5, (end, resumed, uninterrupted.losses)
