"""The memory tier's node folder: private, never through a link, steps sealed by a rename and pruned, and the step
a restart resumes from (the newest one every rank holds somewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_train.checkpoint.memory_store import (
    KEPT_STEPS,
    NodeStore,
    StoreError,
    common_step,
    read_files_list,
    remove_stale_stores,
    why_memory_tier_off,
    write_files_list,
)


def _sealed(store: NodeStore, kind: str, rank: int, step: int, life: int = 0) -> Path:
    tmp = store.begin(kind, rank, (step, life))
    (tmp / "state.pt").write_bytes(b"x" * step)
    return store.seal(tmp, (step, life))


def test_the_folder_is_private_and_named_after_the_job_node_and_agent(tmp_path: Path) -> None:
    store = NodeStore.create("1234", 3, base=tmp_path)
    assert store.root.parent == tmp_path / f"hpc_train-{os.getuid()}"
    assert store.root.name.startswith(f"1234-3-{os.getpid()}-")
    assert oct(store.root.stat().st_mode & 0o777) == oct(0o700)
    assert oct(store.root.parent.stat().st_mode & 0o777) == oct(0o700)
    assert NodeStore.opened(str(store.root)) == store


def test_a_link_planted_where_the_user_folder_goes_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / f"hpc_train-{os.getuid()}").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="not a folder"):
        NodeStore.create("1", 0, base=tmp_path / "shm")
    assert list(elsewhere.iterdir()) == []


def test_a_user_folder_open_to_others_is_refused(tmp_path: Path) -> None:
    user = tmp_path / f"hpc_train-{os.getuid()}"
    user.mkdir(mode=0o700)
    user.chmod(0o777)
    with pytest.raises(StoreError, match="chmod 700"):
        NodeStore.create("1", 0, base=tmp_path)


def test_a_rank_refuses_a_relative_or_linked_folder(tmp_path: Path) -> None:
    store = NodeStore.create("1", 0, base=tmp_path)
    with pytest.raises(StoreError, match="absolute"):
        NodeStore.opened("relative/folder")
    link = store.root.parent / "link"
    link.symlink_to(store.root)
    with pytest.raises(StoreError, match="not a folder"):
        NodeStore.opened(str(link))


def test_steps_are_sealed_by_a_rename_and_the_newest_kept(tmp_path: Path) -> None:
    store = NodeStore.create("1", 0, base=tmp_path)
    unsealed = store.begin("own", 2, (40, 0))
    for step in (10, 20, 30, 40):
        _sealed(store, "own", 2, step)
    assert store.steps("own", 2) == [(40, 0), (30, 0), (20, 0), (10, 0)]
    store.prune("own", 2)
    assert store.steps("own", 2) == [(40, 0), (30, 0), (20, 0)][:KEPT_STEPS]
    _sealed(store, "replica", 5, 30)
    _sealed(store, "replica", 5, 30, life=1)  # the same step again, by the next life
    assert store.holdings() == {2: [(40, 0), (30, 0), (20, 0)][:KEPT_STEPS], 5: [(30, 1), (30, 0)]}
    assert store.find(5, (30, 1)) == store.rank_dir("replica", 5) / "step-30.1"
    assert store.find(5, (40, 0)) is None
    assert unsealed.exists()
    store.clear_unsealed("own", 2)
    assert not unsealed.exists() and store.steps("own", 2)


def test_files_json_round_trips(tmp_path: Path) -> None:
    entries = [{"path": "ds/a.pt", "size": 3, "sha256": "ab"}]
    write_files_list(tmp_path, entries)
    assert read_files_list(tmp_path) == entries
    assert read_files_list(tmp_path / "missing") == []


def test_a_dead_agent_s_folder_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    live = NodeStore.create("7", 0, base=tmp_path)
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
    dead = live.root.parent / f"7-1-{dead_pid}-abcd1234"
    dead.mkdir(mode=0o700)
    assert remove_stale_stores(base=tmp_path) == [dead.name]
    assert live.root.exists() and not dead.exists()


def _life0(*steps: int) -> set[tuple[int, int]]:
    return {(step, 0) for step in steps}


def test_the_common_step_is_the_newest_every_rank_holds() -> None:
    assert common_step({0: _life0(10, 20), 1: _life0(10, 20), 2: _life0(20, 30)}, 3) == ((20, 0), [])
    assert common_step({0: _life0(10, 20), 1: _life0(20)}, 2) == ((20, 0), [])
    assert common_step({0: _life0(10), 2: _life0(10)}, 3) == (None, [1])
    copy, missing = common_step({0: _life0(30), 1: _life0(20)}, 2)
    assert copy is None and missing == [1]


def test_a_step_copied_in_two_lives_is_not_one_state() -> None:
    """Life 0 copied step 30 on rank 0 only (rank 1 died first); life 1 resumed from step 20 and copied step 30
    on rank 1 before it failed too. Step 30 exists for both ranks, but from two trajectories: step 20 it is."""
    held = {0: {(30, 0), (20, 0)}, 1: {(30, 1), (20, 0)}}
    assert common_step(held, 2) == ((20, 0), [])


def _config(**changes: object) -> SimpleNamespace:
    values = {"every": 10, "in_place": 2, "resume": True, "program": "train", "engine": "deepspeed", "shrink": False}
    values.update(changes)
    return SimpleNamespace(checkpoint=SimpleNamespace(memory_every_steps=values["every"], resume=values["resume"]),
                           retry=SimpleNamespace(in_place=values["in_place"], shrink=values["shrink"]),
                           job=SimpleNamespace(program=values["program"]),
                           train=SimpleNamespace(engine=values["engine"]))


@pytest.mark.parametrize(("changes", "why"), [
    ({}, ""),
    ({"every": 0}, "memory_every_steps = 0"),
    ({"in_place": 0}, "retry.in_place = 0"),
    ({"resume": False}, "checkpoint.resume = false"),
    ({"engine": "fsdp2"}, "only the built-in DeepSpeed trainer"),
    ({"program": "examples/fn.py:main"}, "only the built-in DeepSpeed trainer"),
    ({"shrink": True}, "retry.shrink"),
])
def test_where_the_tier_applies(changes: dict[str, object], why: str) -> None:
    said = why_memory_tier_off(_config(**changes), 1, 1)
    assert (why in said) if why else said == ""
    assert "tensor or pipeline" in why_memory_tier_off(_config(), 2, 1)


def test_a_sealed_copy_is_never_replaced_and_a_removed_folder_is_not_made_again(tmp_path: Path) -> None:
    store = NodeStore.create("1", 0, base=tmp_path)
    first = _sealed(store, "fetched", 4, 20)
    tmp = store.begin("fetched", 4, (20, 0))
    (tmp / "state.pt").write_bytes(b"other")
    assert store.seal(tmp, (20, 0)) == first and not tmp.exists()
    assert (first / "state.pt").read_bytes() == b"x" * 20  # a reader in it keeps what it was reading
    store.remove()
    with pytest.raises(FileNotFoundError):
        store.begin("replica", 1, (30, 0))  # a request that arrives after the agent's end
    assert not store.root.exists()
