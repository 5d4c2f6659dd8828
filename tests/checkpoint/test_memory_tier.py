"""The memory tier's decisions that need no job: which step a restart takes from memory (or why the disk), and a
copy skipped where the node's memory would not hold it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpc_train.checkpoint import memory_tier
from hpc_train.checkpoint.memory_store import NodeStore
from hpc_train.checkpoint.memory_tier import MemoryTier, choose_memory_step


def _records(*held: dict[int, list[tuple[int, int]]]) -> list[dict[str, object]]:
    return [{"address": f"n{index}:1", "held": each} for index, each in enumerate(held)]


def test_a_first_life_has_nothing_to_say() -> None:
    assert choose_memory_step(_records({}, {}), 4, 0) == (None, "")


def test_the_newest_step_every_rank_holds_on_any_node_wins_over_an_older_disk() -> None:
    # node 0 holds ranks 0-1 (own) and a replica of 2-3; node 1 lost its own copies of 2-3 (a spare took them)
    records = _records({0: [(30, 0), (20, 0)], 1: [(30, 0), (20, 0)], 2: [(20, 0), (10, 0)], 3: [(20, 0), (10, 0)]},
                       {0: [(20, 0)], 1: [(20, 0)]})
    assert choose_memory_step(records, 4, 10) == ((20, 0), "")
    assert choose_memory_step(records, 4, 20) == ((20, 0), "")  # as new as the disk: memory, read in seconds


def test_a_newer_disk_checkpoint_wins_and_is_said() -> None:
    step, said = choose_memory_step(_records({0: [(20, 0)]}, {1: [(20, 0)]}), 2, 30)
    assert step is None and "the disk checkpoint step 30 is newer" in said


def test_a_rank_whose_memory_and_replica_are_gone_sends_the_restart_to_disk_and_says_which() -> None:
    step, said = choose_memory_step(_records({0: [(20, 0), (10, 0)]}, {}), 2, 10)
    assert step is None
    assert "rank(s) 1 have none in common" in said and "resuming from the disk checkpoint (step 10)" in said
    step, said = choose_memory_step(_records({0: [(30, 0)]}, {1: [(20, 0)]}), 2, 0)
    assert step is None and "(none: from step 0)" in said


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A real process group of one rank: the ranks' agreement on room is a collective."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_a_copy_the_node_has_no_room_for_is_skipped_and_said_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    (tmp_path / "shm").mkdir()
    store = NodeStore.create("5", 0, base=tmp_path / "shm")
    tier = MemoryTier(store, "n0:1", "token", 0, 10, said.append)
    engine = SimpleNamespace(module=torch.nn.Linear(1000, 1000))  # 4 MB of weights: about 16 MB to copy
    monkeypatch.setattr(memory_tier, "available_memory", lambda: 20_000_000)
    assert not tier._room(engine, 10) and not tier._room(engine, 20)
    assert len(said) == 1 and "skipping step 10 on rank 0" in said[0] and "reads the disk checkpoint" in said[0]
    monkeypatch.setattr(memory_tier, "available_memory", lambda: 10**12)
    assert tier._room(engine, 30)
    assert len(said) == 2 and "copying again from step 30" in said[1]
