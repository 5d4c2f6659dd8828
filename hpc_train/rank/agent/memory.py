"""The node agent's part of the memory tier (``[checkpoint] memory_every_steps``, :mod:`~.memory_tier`):
it creates the node's folder in shared memory and removes it at its end, serves it to the job's other agents and
ranks (:class:`~hpc_train.checkpoint.memory_transfer.MemoryServer`), and copies each new step its ranks sealed to
the next node's agent, so that a lost node's ranks find their state on a node that is still there.

Which node: the one after this one in the step's order among the agents that said where their memory is served (a
key on the job's coordinator each), skipping the nodes whose agent vanished; a spare node holds replicas too. The
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
_NONE: Copy = (-1, -1)


def memory_key(attempt: str, node: int) -> str:
    """The coordinator's key where node ``node``'s agent says where its memory is served."""
    return f"{attempt}/memory/{node}"


class NodeMemory:
    """One node's memory tier, held by its agent (see the module's docstring)."""

    def __init__(self, store: NodeStore, server: MemoryServer, host: str, link: AgentLink, node: int,
                 log: logging.Logger) -> None:
        self.store, self.server, self.host, self.link, self.node, self.log = store, server, host, link, node, log
        self.address = f"{host}:{server.port}"
        self.pushed: dict[int, Copy] = {}  # rank: the newest copy sent to another node (or found nowhere to go)
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
        return cls(store, server, host, link, setup.node, log)

    def environment(self) -> dict[str, str]:
        """What the node's ranks need: the folder, and where their agent serves it."""
        return {MEMORY_DIR_ENV: str(self.store.root), MEMORY_ADDRESS_ENV: self.address}

    def tick(self) -> None:
        """On the agent's watch (every 0.2 s; a local folder of a few entries): each rank's sealed steps go to the
        next node in order, one push at a time per rank, so that the replicas hold the steps the ranks' own
        copies hold and a restart finds a step common to all."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + _LOOK_EVERY_S
        for rank in self.store.ranks("own"):
            if rank in self._busy:
                continue
            waiting = sorted(copy for copy in self.store.steps("own", rank) if copy > self.pushed.get(rank, _NONE))
            if not waiting:
                continue
            target = self.target()
            if target is None:
                if not self._said_alone:
                    self.log.warning("memory tier: no other node's agent to hold a replica: a lost node's ranks "
                                     "will resume from the disk checkpoint")
                    self._said_alone = True
                self.pushed[rank] = waiting[-1]
                continue
            self._busy.add(rank)
            self._pending.put((rank, waiting[0], target))

    def target(self) -> str | None:
        """The memory address of the next node after this one (in the step's order) whose agent is still there."""
        prefix = f"{self.link.attempt}/memory/"
        _count, _names, lost = self.link.lost()
        peers: dict[int, str] = {}
        for key, value in list(self.link.client.known.items()):
            if not key.startswith(prefix) or not isinstance(value, dict) or value.get("node") in lost:
                continue
            node = key[len(prefix):]
            if node.isdigit() and int(node) != self.node:
                peers[int(node)] = f"{value.get('host')}:{value.get('port')}"
        if not peers:
            return None
        after = [node for node in sorted(peers) if node > self.node]
        return peers[(after or sorted(peers))[0]]

    def _push_loop(self) -> None:
        while (item := self._pending.get()) is not None:
            rank, copy, target = item
            step = copy[0]
            try:
                folder = self.store.rank_dir("own", rank) / copy_name(copy)
                started = time.perf_counter()
                push_step(target, self.link.address.token, folder, rank, copy)
                if rank not in self.pushed:  # the first copy of each rank is said; the rest only when they fail
                    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
                    self.log.info("memory tier: rank %d's step %d (%.1f MB) copied to %s in %.2f s (each new copy "
                                  "follows)", rank, step, size / 1e6, target, time.perf_counter() - started)
            except (TransferError, OSError) as error:  # a folder pruned meanwhile, a peer gone or full
                self.log.warning("memory tier: rank %d's step %d was not copied to %s: %s", rank, step, target,
                                 error)
            finally:
                self.pushed[rank] = max(copy, self.pushed.get(rank, _NONE))
                self._busy.discard(rank)

    def close(self) -> None:
        """At the agent's end: the server stops, the node's memory is given back."""
        self._pending.put(None)
        self.server.stop()
        self._thread.join(timeout=5)
        self.store.remove()


def memory_environment(memory: Any) -> dict[str, str]:
    return memory.environment() if memory is not None else {}
