"""The prepared GPU check runs end to end on this CPU machine (--cpu-dry-run: gloo, fp32, tiny sizes), so the
script a lent GPU machine runs once is known to work before that machine's minutes are spent on it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
GPU_ONLY = {"tiny-fp16-zero2", "tiny-zero3-offload-cpu-adam", "tiny-fused-adam", "125M-zero2"}


def test_the_gpu_check_runs_every_step_on_cpus(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-dry-run", "--out", str(out),
                             "--work", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True,
                            timeout=900, check=False)
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert list(steps) == ["environment", "trainer", "resume", "user_checkpoint", "bench", "hang", "relife", "mfu"]
    failed = {name: step for name, step in steps.items() if step["status"] != "passed"}
    assert result.returncode == 0 and not failed, (failed, result.stdout[-3000:])
    trainer = steps["trainer"]["result"]
    assert trainer["tiny-zero2"]["status"] == "passed" and trainer["tiny-zero2"]["precision"] == "fp32"
    fsdp2 = trainer["tiny-fsdp2"]
    assert fsdp2["status"] == "passed" and fsdp2["final_loss"] < fsdp2["first_loss"]
    assert {name for name, part in trainer.items() if part["status"] == "skipped"} == GPU_ONLY
    assert steps["resume"]["result"]["bitwise_equal"] is True
    assert steps["user_checkpoint"]["result"]["attempts"][0][0] == "preempted"
    assert steps["hang"]["result"]["outcome"] == "hang"
    relife = steps["relife"]["result"]
    assert relife["bitwise_equal"] and relife["first_engine_freed"] and relife["staging"]["writer_thread_ended"]
    assert relife["staging"]["written"] == ["module.pt"]  # the staged file reached the writer thread
    assert steps["mfu"]["result"]["tiny"]["ratio"] > 0
