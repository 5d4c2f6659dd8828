"""The import paths from before the rooms moved keep working: an old name is the new module itself (never a
second copy of its classes), with a warning that names the new path; ``python -m`` of an old name runs the new
module."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from hpc_train._moved import MOVED, new_name
from tests.conftest import REPO


def test_every_old_name_points_at_a_module_that_exists() -> None:
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}"
    assert new_name("hpc_train.train.models.gpt") == "hpc_train.rank.train.models.gpt"
    assert new_name("hpc_train.train.memory") == "hpc_train.config.memory"  # the longest match wins
    assert new_name("hpc_train.config.plan") is None and new_name("hpc_train.trainer") is None


@pytest.mark.parametrize(("old", "new", "name"), [
    ("hpc_train.train.pipeline_layers", "hpc_train.rank.train.pipeline_layers", "pipeline_layers"),
    ("hpc_train.distributed.tensor_parallel", "hpc_train.rank.distributed.tensor_parallel", "ColumnParallelLinear"),
    ("hpc_train.ops.recovery", "hpc_train.failures.recovery", "look_back"),
    ("hpc_train.ckpt.manager", "hpc_train.checkpoint.manager", "CheckpointManager"),
])
def test_an_old_import_path_is_the_new_module_itself(old: str, new: str, name: str) -> None:
    sys.modules.pop(old, None)  # imported fresh here, so the finder answers and warns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and getattr(module, name) is getattr(sys.modules[new], name)
    assert any(f"{old} is now {new}" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_python_dash_m_of_an_old_name_runs_the_new_module() -> None:
    result = subprocess.run([sys.executable, "-m", "hpc_train.train.prepare", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "python -m hpc_train.login.prepare" in result.stdout, result.stderr


def test_the_doors_still_hand_out_what_their_modules_held() -> None:
    import hpc_train.agent
    import hpc_train.launch
    import hpc_train.submit
    from hpc_train.login.submit import build_parser
    from hpc_train.rank.agent.agent import supervise
    from hpc_train.rank.entry import run_rank

    assert hpc_train.launch.run_rank is run_rank and hpc_train.agent.supervise is supervise
    assert hpc_train.submit.build_parser is build_parser
