"""Each rank's random state in one file per node (issue 38): gathered on the node's first rank over a group of
the node's ranks alone, and each rank's own found again by its rank, a legacy ``rank-N.pt`` too."""

from __future__ import annotations

import multiprocessing
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_train.rank.runtime import random_state
from hpc_train.rank.runtime.node_states import NodeStates, node_file_name, rank_state_name


def test_names_say_which_ranks_a_file_holds() -> None:
    assert [node_file_name(rank, 4) for rank in (0, 3, 4)] == ["ranks-0-3.pt", "ranks-0-3.pt", "ranks-4-7.pt"]
    names = ["ranks-0-3.pt", "ranks-4-7.pt", "rank-5.pt", "ranks-9-8.pt", f"ranks-0-{'9' * 40}.pt"]
    assert rank_state_name(names, 2) == "ranks-0-3.pt" and rank_state_name(names, 5) == "rank-5.pt"
    assert rank_state_name(names, 6) == "ranks-4-7.pt" and rank_state_name(names, 8) is None


def _rank(rank: int, world: int, store: str, folder: str, queue: multiprocessing.Queue) -> None:
    # a file store: a port picked free and given to rank 0 can be taken by another test's process meanwhile
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        random.seed(100 + rank)
        torch.manual_seed(100 + rank)
        states = NodeStates(rank, world, per_node=2)
        gathered = states.gather(lambda: random_state.capture(torch.device("cpu")))
        if gathered is not None:
            torch.save(gathered, os.path.join(folder, states.file_name))
        dist.barrier()
        expected = (random.random(), torch.rand(3).tolist())  # noqa: S311 (the state under test)
        random.seed(0)
        torch.manual_seed(0)
        mine = states.pick(folder, lambda path: torch.load(path, weights_only=True))
        assert mine is not None
        random_state.restore(mine, torch.device("cpu"))
        after = (random.random(), torch.rand(3).tolist())  # noqa: S311
        queue.put((rank, gathered is not None, expected == after))
    finally:
        dist.destroy_process_group()


def test_the_ranks_of_each_node_write_one_file_and_each_restores_its_own(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    store, folder = tmp_path / "store", tmp_path / "states"
    folder.mkdir()
    workers = [context.Process(target=_rank, args=(rank, 4, str(store), str(folder), queue)) for rank in range(4)]
    for worker in workers:
        worker.start()
    results = sorted(queue.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(60)
    assert results == [(0, True, True), (1, False, True), (2, True, True), (3, False, True)]
    assert sorted(os.listdir(folder)) == ["ranks-0-1.pt", "ranks-2-3.pt"]
    node = torch.load(folder / "ranks-2-3.pt", weights_only=True)
    assert sorted(node) == ["2", "3"] and not torch.equal(node["2"]["torch"], node["3"]["torch"])


def test_a_rank_without_a_file_and_a_legacy_file_and_a_linked_folder(tmp_path: Path) -> None:
    folder = tmp_path / "rng"
    folder.mkdir()
    state = random_state.capture(torch.device("cpu"))
    torch.save(state, folder / "rank-5.pt")
    torch.save({"0": state}, folder / "ranks-0-0.pt")
    load = lambda path: torch.load(path, weights_only=True)  # noqa: E731
    assert torch.equal(NodeStates(5, 8, 1).pick(folder, load)["torch"], state["torch"])
    assert torch.equal(NodeStates(0, 8, 1).pick(folder, load)["torch"], state["torch"])
    assert NodeStates(7, 8, 1).pick(folder, load) is None  # a rank new since the save
    assert NodeStates(0, 8, 1).pick(tmp_path / "missing", load) is None
    (tmp_path / "linked").symlink_to(folder)
    assert NodeStates(0, 8, 1).pick(tmp_path / "linked", load) is None


def _failing_rank(rank: int, world: int, store: str, queue: multiprocessing.Queue) -> None:
    """Rank 1's state cannot be made: it still takes part in the gather (its peer is not left waiting), then
    raises; rank 0 gets the node's file without rank 1's entry."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        def make() -> dict:
            if rank == 1:
                raise OSError("no state on rank 1")
            return random_state.capture(torch.device("cpu"))

        try:
            gathered = NodeStates(rank, world, per_node=2, timeout_s=60).gather(make)
            queue.put((rank, sorted(gathered) if gathered is not None else None))
        except OSError as error:
            queue.put((rank, str(error)))
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_state_cannot_be_made_leaves_no_peer_waiting(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_failing_rank, args=(rank, 2, str(tmp_path / "store"), queue))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    results = sorted(queue.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(60)
    assert results == [(0, ["0"]), (1, "no state on rank 1")]


def test_the_manifest_s_names_are_used_without_a_listing(tmp_path: Path) -> None:
    state = random_state.capture(torch.device("cpu"))
    torch.save({"0": state, "1": state}, tmp_path / "ranks-0-1.pt")
    torch.save({"0": state}, tmp_path / "unlisted.pt")
    load = lambda path: torch.load(path, weights_only=True)  # noqa: E731
    assert NodeStates(1, 2, 2).pick(tmp_path, load, names=["ranks-0-1.pt"]) is not None
    assert NodeStates(1, 2, 2).pick(tmp_path, load, names=[]) is None  # the manifest vouches for no file
