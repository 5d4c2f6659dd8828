"""Lightning, Hugging Face Trainer and accelerate scripts on 2 nodes of the local Slurm cluster, sent USR2 once and
followed as users run them (``hpc_train.submit`` without ``--no-follow``): Hugging Face Trainer's and accelerate's
with hpc_train's integration, Lightning's without it (a script that knows nothing of hpc_train takes the same path
whatever its library, and tests/integrations/test_libraries_local.py runs the other two unmodified; it also
preempts Lightning's with the integration, at steps chosen around its epoch's end, which a random step here hit
only sometimes). ``submit`` exits 0, the run was preempted, requeued and completed, ``logs --errors-only`` shows no
failure, and the final weights are bitwise equal to an uninterrupted ``torchrun`` of the same script. With the
integration, no step is lost or trained twice and every step is in the metrics exactly once.

The three runs are benchmarks/library_preemption.py's (all at once; about 100 s; its figures in
docs/performance.md are of all six); the signal steps are random (the seed is printed on failure)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO
from tests.slurm.cluster import slurm_cluster

__all__ = ["slurm_cluster"]  # the fixture (skip, or fail where HPC_TRAIN_REQUIRE_SLURM=1), asked for by name

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]
STEPS = 100  # the benchmark's


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "library_preemption.py"), "--json",
                             "--plain-libs", "lightning", "--integrated-libs", "hf_trainer,accelerate"],
                            capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    print(result.stdout.split("\n{", 1)[0])  # the seed and the table, shown when a test fails
    return {record["name"]: record for record in records}


@pytest.mark.parametrize(("lib", "integration"), [("lightning", False), ("hf_trainer", True), ("accelerate", True)],
                         ids=["plain-lightning", "integration-hf_trainer", "integration-accelerate"])
def test_a_preempted_followed_run_is_requeued_resumed_and_ends_with_the_uninterrupted_weights(
        runs: dict[str, dict[str, Any]], lib: str, integration: bool) -> None:
    run = runs[f"{lib}{' + integration' if integration else ' (plain)'}"]
    assert run["exit_code"] == 0, run["output_tail"]
    assert run["outcomes"] == ["preempted", "completed"], run
    assert run["failures"] == [], run["failures"]
    assert run["bitwise"] is True, {k: v for k, v in run.items() if k not in ("metric_steps", "output_tail")}
    assert run["restart_s"] is not None and run["stopped_after"] is not None
    if integration:
        assert run["twice"] == 0 and run["resumed_from"] == run["stopped_after"] >= run["signal_at"], run
        assert run["metric_steps"] == list(range(1, STEPS + 1))  # every step once: none lost, none twice
    else:
        assert run["resumed_from"] in (20, 40, 60, 80) and run["stopped_after"] > run["signal_at"], run
