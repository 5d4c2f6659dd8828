"""The seeds' kind of ds_config.json (fp16, ZeRO-3, the optimizer offloaded to the CPU, a micro batch per GPU,
Adam with its lr: ``examples/hf_gpt2/ds_config.json``) trains the Hugging Face GPT-2 on 2 ranks through
``[train] deepspeed_config``. On CPUs fp16 cannot run and DeepSpeed's CPU Adam takes minutes to compile on two
cores, so this trial sets ``train.precision=fp32``, ``zero.offload_optimizer=false`` and
``train.optimizer=torch_adamw`` on the command line (``--set`` wins over the file, and the plan says so); every
other key of the file reaches DeepSpeed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("transformers", reason="the hf extra (pip install 'hpc_train[hf]') is missing")
pytestmark = pytest.mark.slow
EXAMPLE = REPO / "examples" / "hf_gpt2"


def test_the_seed_ds_config_trains_the_hf_gpt2_on_two_ranks(tmp_path: Path) -> None:
    tokens = tmp_path / "corpus.u16"
    subprocess.run([sys.executable, "-m", "hpc_train.login.prepare", str(REPO / "examples" / "corpus" /
                    "hpc_train_docs.txt"), str(tokens)], check=True, capture_output=True, timeout=60)
    job = tmp_path / "job.toml"
    job.write_text((EXAMPLE / "job.toml").read_text().replace("[zero]\nstage = 2\n", "").replace(
        'model = "gpt2.py:model"', f'model = "{EXAMPLE}/gpt2.py:model"\ndeepspeed_config = "ds_config.json"').replace(
        'source = "gpt2.py:dataset"', f'source = "{EXAMPLE}/gpt2.py:dataset"').replace(
        "micro_batch = 8\n", "").replace("lr = 1e-3\n", ""))
    (tmp_path / "ds_config.json").write_text((EXAMPLE / "ds_config.json").read_text())
    result = subprocess.run([sys.executable, "-m", "hpc_train.submit", str(job), "--site", "local", "--set",
                             f"data.path={tokens}", "--set", "train.steps=12", "--set", "monitor.log_every=4",
                             "--set", "monitor.eval_every=0", "--set", "train.precision=fp32", "--set",
                             "zero.offload_optimizer=false", "--set", "train.optimizer=torch_adamw"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=400, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "train.precision: the file says 'fp16', --set gave another value" in " ".join(
        result.stdout.replace("│", " ").split())  # the plan names what --set changed
    run_dir = tmp_path / "runs" / "hf-gpt2"
    ds = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 1e9  # passed through from the file
    assert ds["fp16"]["initial_scale_power"] == 16 and ds["fp16"]["enabled"] is False
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    rates = [r["lr"] for r in records if "lr" in r]
    assert 5e-4 < max(rates) <= 1e-3  # the file's Adam lr is the peak of the schedule
