"""The node agent's memory tier, with two agents on a real coordinator: each says where its memory is served, a
step its rank sealed is copied to the next node's agent, and the folder goes with the agent."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from hpc_train.checkpoint.memory_store import MEMORY_ADDRESS_ENV, MEMORY_DIR_ENV, NodeStore
from hpc_train.rank.agent.link import AgentLink
from hpc_train.rank.agent.memory import NodeMemory
from hpc_train.rank.agent.setup import AgentSetup

log = logging.getLogger("test-memory")


def _setup(run_dir: Path, node: int, memory: bool = True) -> AgentSetup:
    return AgentSetup(run_dir, node, ("n0", "n1"), 2, "41", 0, 2, "USR2", 1, memory=memory)


def _until(condition: object, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_a_sealed_step_is_copied_to_the_next_node_and_the_folders_go_with_the_agents(tmp_path: Path) -> None:
    (tmp_path / "heartbeats").mkdir(mode=0o700)
    first = AgentLink.open(tmp_path, "41.0.0", "41", "node-0@n0", log, host=True)
    second = AgentLink.open(tmp_path, "41.0.0", "41", "node-1@n1", log, host=False)
    assert first is not None and second is not None
    memories = [NodeMemory.open(_setup(tmp_path, node), link, "41.0.0", log) for node, link in
                enumerate((first, second))]
    try:
        zero, one = memories
        assert zero is not None and one is not None
        env = zero.environment()
        assert NodeStore.opened(env[MEMORY_DIR_ENV]) == zero.store and env[MEMORY_ADDRESS_ENV] == zero.address
        _until(lambda: zero.target() == one.address and one.target() == zero.address)
        tmp = zero.store.begin("own", 0, (10, 0))
        (tmp / "rng.pt").write_bytes(b"state of rank 0")
        zero.store.seal(tmp, (10, 0))
        zero.tick()
        _until(lambda: one.store.holdings() == {0: [(10, 0)]})
        assert (one.store.find(0, (10, 0)) / "rng.pt").read_bytes() == b"state of rank 0"
        assert zero.pushed == {0: {(10, 0)}}
    finally:
        for memory in memories:
            if memory is not None:
                memory.close()
        second.close()
        first.close()
    assert not zero.store.root.exists() and not one.store.root.exists()


def test_no_tier_without_the_plan_s_word_or_without_a_coordinator(tmp_path: Path) -> None:
    assert NodeMemory.open(_setup(tmp_path, 0, memory=False), None, "41.0.0", log) is None
    assert NodeMemory.open(dataclasses.replace(_setup(tmp_path, 0)), None, "41.0.0", log) is None


def test_a_later_life_s_copy_below_the_last_one_sent_is_sent_too(tmp_path: Path) -> None:
    """Life 0 copied step 30; life 1 resumed from disk at step 10 and copies step 20: its replica goes too."""
    (tmp_path / "heartbeats").mkdir(mode=0o700)
    first = AgentLink.open(tmp_path, "41.0.0", "41", "node-0@n0", log, host=True)
    second = AgentLink.open(tmp_path, "41.0.0", "41", "node-1@n1", log, host=False)
    assert first is not None and second is not None
    zero = NodeMemory.open(_setup(tmp_path, 0), first, "41.0.0", log)
    one = NodeMemory.open(_setup(tmp_path, 1), second, "41.0.0", log)
    try:
        assert zero is not None and one is not None
        for copy in ((30, 0), (20, 1)):
            tmp = zero.store.begin("own", 0, copy)
            (tmp / "rng.pt").write_bytes(b"x")
            zero.store.seal(tmp, copy)
            _until(lambda copy=copy: (zero.tick(), copy in one.store.holdings().get(0, []))[1])
        assert one.store.holdings() == {0: [(30, 0), (20, 1)]}
    finally:
        for memory in (zero, one):
            if memory is not None:
                memory.close()
        second.close()
        first.close()
