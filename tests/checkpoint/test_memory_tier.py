"""The memory tier's decisions that need no job: which step a restart takes from memory (or why the disk), and a
copy skipped where the node's memory would not hold it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpc_train.checkpoint import memory_tier
from hpc_train.checkpoint.memory_store import NodeStore, write_files_list
from hpc_train.checkpoint.memory_tier import MemoryTier, choose_memory_step
from hpc_train.checkpoint.names import DEEPSPEED_TAG


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


def _copy_of(store: NodeStore, rank: int, names: dict[str, bytes]) -> Path:
    tmp = store.begin("own", rank, (20, 1))
    entries = []
    for name, data in names.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
        entries.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    write_files_list(tmp, entries)
    return store.seal(tmp, (20, 1))


def test_a_rank_whose_copy_lacks_the_module_links_its_node_s_first_rank_s(tmp_path: Path) -> None:
    """ZeRO 0-2: only the node's first rank (here rank 2 of ranks 2-3) copies the module's file; rank 3's load
    links it into its own folder, with its entry to check it against."""
    (tmp_path / "shm").mkdir()
    store = NodeStore.create("5", 1, base=tmp_path / "shm")
    module = f"{DEEPSPEED_TAG}/mp_rank_00_model_states.pt"
    _copy_of(store, 2, {module: b"module", f"{DEEPSPEED_TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"a"})
    folder = _copy_of(store, 3, {f"{DEEPSPEED_TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt": b"b"})
    tier = MemoryTier(store, "n1:1", "token", 3, 10, print, life=1, per_node=2)
    assert tier.first == 2
    linked, problem = tier.module_into(folder, (20, 1), [])
    assert problem is None and [entry.path for entry in linked] == [module]
    assert (folder / module).read_bytes() == b"module"
    assert (folder / module).stat().st_ino == (store.find(2, (20, 1)) / module).stat().st_ino  # a link, no copy
    assert tier.module_into(folder, (20, 1), []) == (linked, None)  # linked before: still checked at each load


def test_a_module_held_nowhere_is_a_problem_not_a_load(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    store = NodeStore.create("5", 1, base=tmp_path / "shm")
    folder = _copy_of(store, 3, {f"{DEEPSPEED_TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt": b"b"})
    tier = MemoryTier(store, "n1:1", "token", 3, 10, print, life=1, per_node=2)
    linked, problem = tier.module_into(folder, (20, 1), [])
    assert linked == [] and problem == "rank 2's step 20: no node holds it"
