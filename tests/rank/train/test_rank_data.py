"""``[data]`` on a rank, in one process with a real one-rank gloo group: the user's dataset for each split
(None for no evaluation), the collate function, and the built-in tokens as a dataset."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_train.common.topology import Topology
from hpc_train.config.job import JobConfig
from hpc_train.config.loader import build
from hpc_train.config.plan import make_plan
from hpc_train.config.sites import load_site
from hpc_train.rank.distributed.context import RankContext
from hpc_train.rank.distributed.launchers import LaunchInfo
from hpc_train.rank.distributed.mesh import ParallelGroups
from hpc_train.rank.train.rank_data import build_data

CODE = """
import torch

def dataset(ctx, split):
    if split == "eval":
        return None
    return torch.utils.data.TensorDataset(torch.arange(32.0).reshape(16, 2), torch.arange(16))

def pairs(samples):
    return {"x": torch.stack([s[0] for s in samples]), "n": len(samples)}
"""


@pytest.fixture
def groups(tmp_path: Path) -> Iterator[ParallelGroups]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield ParallelGroups(Topology.build(1))
    dist.destroy_process_group()


def _ctx(tmp_path: Path, groups: ParallelGroups, data: dict[str, object]) -> RankContext:
    (tmp_path / "data.py").write_text(CODE)
    config = build(JobConfig, {"train": {"micro_batch": 4, "seq_len": 8}, "data": data})
    plan = make_plan(config, load_site("local"), "local", cwd=tmp_path, config_dir=tmp_path)
    info = LaunchInfo("single", 0, 0, 1, 1, 0, 1, "localhost", "1", "", 0)
    return RankContext(plan, info, tmp_path, groups, torch.device("cpu"))


def test_a_user_dataset_with_its_collate_and_no_evaluation_set(tmp_path: Path, groups: ParallelGroups) -> None:
    ctx = _ctx(tmp_path, groups, {"source": "data.py:dataset", "collate": "data.py:pairs"})
    data = build_data(ctx, groups, torch.device("cpu"))
    batch = next(data.train)
    assert batch["n"] == 4 and batch["x"].shape == (4, 2)
    assert data.train.state_dict() == {"epoch": 0, "offset": 4}
    assert data.eval_stream() is None


def test_the_built_in_tokens_are_a_dataset_of_input_and_target_pairs(tmp_path: Path, groups: ParallelGroups) -> None:
    data = build_data(_ctx(tmp_path, groups, {"source": "synthetic", "vocab_size": 32}), groups, torch.device("cpu"))
    inputs, targets = next(data.train)
    assert inputs.shape == targets.shape == (4, 8) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    evaluation = data.eval_stream()
    assert evaluation is not None and not torch.equal(next(evaluation)[0], inputs)  # its own order


def test_the_evaluation_loads_in_the_training_process_whatever_the_workers(tmp_path: Path,
                                                                            groups: ParallelGroups) -> None:
    """Training gets its two workers; the evaluation's four micro-batches start none (a fork per evaluation cost
    more than it saved, and forked a process with running threads), and give the same batches each time."""
    ctx = _ctx(tmp_path, groups, {"source": "synthetic", "vocab_size": 32, "num_workers": 2, "prefetch_factor": 2,
                                  "persistent_workers": True})
    data = build_data(ctx, groups, torch.device("cpu"))
    first, second = data.eval_stream(), data.eval_stream()
    assert first is not None and second is not None
    assert data.train.settings.num_workers == 2 and first.settings.num_workers == 0
    assert torch.equal(next(first)[0], next(second)[0])  # the same evaluation batches every time
    first.close()
    second.close()
