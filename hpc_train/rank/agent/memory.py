"""The node agent's part of the memory tier (``[checkpoint] memory_every_steps``, :mod:`~.memory_tier`):
it creates the node's folder in shared memory and removes it at its end, serves it to the job's other agents and
ranks (:class:`~hpc_train.checkpoint.memory_transfer.MemoryServer`), and copies each new step its ranks sealed to
the next node's agent, so that a lost node's ranks find their state on a node that is still there.

Which node: the one after this one in the step's order among the agents that said where their memory is served (a
key on the job's coordinator each, asked for when needed), skipping the nodes whose agent vanished; a spare node
holds replicas too. The
agent looks at its folder on its 0.2 s watch of the ranks (a local folder of a few entries: no shared filesystem),
and pushes every sealed step in order from a thread of its own, so the watch never waits on the network.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from typing import Any

from hpc_train.checkpoint.memory_store import (
    MEMORY_ADDRESS_ENV,
    MEMORY_DIR_ENV,
    Copy,
    NodeStore,
    StoreError,
    copy_name,
    remove_stale_stores,
)
from hpc_train.checkpoint.memory_transfer import MemoryServer, TransferError, push_step
from hpc_train.control.client import ControlError
from hpc_train.rank.agent.link import AgentLink
from hpc_train.rank.agent.setup import AgentSetup

__all__ = ["NodeMemory", "memory_key"]

_LOOK_EVERY_S = 0.2


def memory_key(attempt: str, node: int) -> str:
    """The coordinator's key where node ``node``'s agent says where its memory is served (outside the ``ATTEMPT/``
    prefix the agents watch: it is asked for, not pushed)."""
    return f"memory/{attempt}/{node}"


class NodeMemory:
    """One node's memory tier, held by its agent (see the module's docstring)."""

    def __init__(self, store: NodeStore, server: MemoryServer, host: str, link: AgentLink, node: int, nodes: int,
                 log: logging.Logger) -> None:
        self.store, self.server, self.host, self.link, self.log = store, server, host, link, log
        self.node, self.nodes = node, nodes
        self.address = f"{host}:{server.port}"
        self.pushed: dict[int, set[Copy]] = {}  # rank: the copies sent to another node (or found nowhere to go)
        self._said: dict[int, bool] = {}
        self._target: tuple[str, str] | None = None  # (address, node name) of the node that holds the replicas
        self._target_failed = False
        self._pending: queue.Queue[tuple[int, Copy, str] | None] = queue.Queue()
        self._busy: set[int] = set()
        self._next_look = 0.0
        self._said_alone = False
        self._thread = threading.Thread(target=self._push_loop, name="memory-tier-replica", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, setup: AgentSetup, link: AgentLink | None, attempt: str, log: logging.Logger) -> NodeMemory | None:
        """The node's tier where the plan asks for one (:attr:`AgentSetup.memory`); None, said, where it cannot
        be kept (no coordinator to find the other nodes, no private folder in ``/dev/shm``)."""
        if not setup.memory:
            return None
        if link is None:
            log.warning("memory tier off on %s: without the job's coordinator the nodes cannot find each other's "
                        "memory; a restart reads the disk checkpoint", setup.node_name)
            return None
        try:
            for name in remove_stale_stores():
                log.info("memory tier: removed %s, left in /dev/shm by an agent that is gone", name)
            store = NodeStore.create(setup.job_id, setup.node)
        except (StoreError, OSError) as error:
            log.warning("memory tier off on %s: %s", setup.node_name, error)
            return None
        try:
            server = MemoryServer(store, link.address.token).start()
        except OSError as error:  # no port to listen on
            store.remove()
            log.warning("memory tier off on %s: its server cannot listen (%s)", setup.node_name, error)
            return None
        host = socket.gethostname()
        with contextlib.suppress(ControlError):
            link.client.set(memory_key(attempt, setup.node), {"host": host, "port": server.port,
                                                               "node": setup.node_name})
        log.info("memory tier: the ranks' states in %s, served on %s:%d", store.root, host, server.port)
        return cls(store, server, host, link, setup.node, len(setup.nodes), log)

    def environment(self) -> dict[str, str]:
        """What the node's ranks need: the folder, and where their agent serves it."""
        return {MEMORY_DIR_ENV: str(self.store.root), MEMORY_ADDRESS_ENV: self.address}

    def tick(self) -> None:
        """On the agent's watch (every 0.2 s; a local folder of a few entries): each rank's sealed copies go to the
        next node, oldest first, one push at a time per rank, so that the replicas hold the copies the ranks' own
        folders hold and a restart finds one common to all. A copy is sent once, whatever its (step, life): a life
        that resumed from an older step copies steps below the last one sent, and those go too."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + _LOOK_EVERY_S
        for rank in self.store.ranks("own"):
            if rank in self._busy:
                continue
            held = set(self.store.steps("own", rank))
            sent = self.pushed.setdefault(rank, set())
            sent &= held  # pruned ones are forgotten: the set stays as small as the folder
            waiting = sorted(held - sent)
            if not waiting:
                continue
            target = self.target()
            if target is None:
                if not self._said_alone:
                    self.log.warning("memory tier: no other node's agent to hold a replica: a lost node's ranks "
                                     "will resume from the disk checkpoint")
                    self._said_alone = True
                sent.update(waiting)
                continue
            self._busy.add(rank)
            self._pending.put((rank, waiting[0], target))

    def target(self) -> str | None:
        """The memory address of the next node after this one (in the step's order) whose agent is still there,
        asked of the coordinator when first needed and again once that node is lost or a push to it failed: a
        key per node that no agent watches (pushed to every agent, N keys would be N^2 messages at 16,384 ranks)."""
        lost = set(self.link.lost()[2])
        if self._target is not None and self._target[1] not in lost and not self._target_failed:
            return self._target[0]
        self._target, self._target_failed = None, False
        for step in range(1, self.nodes):
            node = (self.node + step) % self.nodes
            try:
                value = self.link.client.get(memory_key(self.link.attempt, node))
            except ControlError:
                return None
            if isinstance(value, dict) and value.get("node") not in lost:
                self._target = (f"{value.get('host')}:{value.get('port')}", str(value.get("node")))
                return self._target[0]
        return None

    def _push_loop(self) -> None:
        while (item := self._pending.get()) is not None:
            rank, copy, target = item
            step = copy[0]
            try:
                folder = self.store.rank_dir("own", rank) / copy_name(copy)
                started = time.perf_counter()
                push_step(target, self.link.address.token, folder, rank, copy)
                if not self._said.get(rank):  # the first copy of each rank is said; the rest only when they fail
                    self._said[rank] = True
                    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
                    self.log.info("memory tier: rank %d's step %d (%.1f MB) copied to %s in %.2f s (each new copy "
                                  "follows)", rank, step, size / 1e6, target, time.perf_counter() - started)
            except (TransferError, OSError) as error:  # a folder pruned meanwhile, a peer gone or full
                self._target_failed = True  # the next look asks the coordinator again
                self.log.warning("memory tier: rank %d's step %d was not copied to %s: %s", rank, step, target,
                                 error)
            finally:
                self.pushed.setdefault(rank, set()).add(copy)
                self._busy.discard(rank)

    def close(self) -> None:
        """At the agent's end: the server stops, the node's memory is given back."""
        self._pending.put(None)
        self.server.stop()
        self._thread.join(timeout=5)
        self.store.remove()


def memory_environment(memory: Any) -> dict[str, str]:
    return memory.environment() if memory is not None else {}
