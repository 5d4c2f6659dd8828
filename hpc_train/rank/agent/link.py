"""The agents' side of the control plane (:mod:`hpc_train.control`): the first node's agent hosts the coordinator,
every node's agent holds one connection to it for the Slurm attempt.

What goes over it instead of the run folder: the restart notice (set once, first writer wins, pushed to every
agent), the restart barrier (each agent arrives once; the coordinator sets the barrier's key when all did, so the
decision is made within a message's time of the last report; one arrival per node), a member that vanished (its
connection dropped: its node is lost, and the barrier will not complete), and the hand-over to the next job of a
chain. The files stay as the durable record, written at each event, and as the fallback when the coordinator cannot
be reached (``link`` is None or broken): the agent then reads them as before.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hpc_train.control.client import ControlClient, ControlError
from hpc_train.control.discovery import Address, find_address, new_token, publish_address
from hpc_train.control.server import GONE_KEY, ControlServer
from hpc_train.run.assignment import assignment_key, left_key
from hpc_train.run.chain import handover_key
from hpc_train.run.in_place import RestartNotice, notice_from, ready_key, request_restart, restart_key
from hpc_train.run.paths import control_address_path

__all__ = ["AgentLink"]

_FIND_S = 60.0  # how long an agent looks for the coordinator's address before it falls back to the files


def _connect(address: Address, member: str, deadline: float) -> ControlClient:
    """Connect, trying again until ``deadline``: thousands of agents connecting at once may overflow the listen
    backlog, and an agent that gave up at the first refusal would coordinate through the files alone."""
    delay = 0.1
    while True:
        try:
            return ControlClient.connect(address.host, address.port, address.token, member, agent=True)
        except ControlError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2.0, delay * 2)


class AgentLink:
    """One agent's connection (and, on the first node's agent, the coordinator itself)."""

    def __init__(self, client: ControlClient, address: Address, server: ControlServer | None, attempt: str,
                 job_id: str) -> None:
        self.client, self.address, self.server = client, address, server
        self.attempt, self.job_id = attempt, job_id

    @classmethod
    def open(cls, run_dir: Path, attempt: str, job_id: str, member: str, log: logging.Logger,
             host: bool) -> AgentLink | None:
        """Host the coordinator (``host``: the agent of the step's first node) and connect as
        ``member``; None (the files are used) when that fails."""
        path = control_address_path(run_dir, attempt)
        server = None
        try:
            if host:
                server = ControlServer(new_token()).start()
                address = Address(socket.gethostname(), server.port, server.token)
                publish_address(path, address)
            else:
                found = find_address(path, _FIND_S)
                if found is None:
                    log.warning("no coordinator for attempt %s within %.0f s: the agents coordinate through the "
                                "run folder", attempt, _FIND_S)
                    return None
                address = found
            client = _connect(address, member, time.monotonic() + _FIND_S)
            for prefix in (f"{attempt}/", GONE_KEY, handover_key(job_id)):
                client.watch(prefix)
        except (ControlError, OSError) as error:
            log.warning("the coordinator of attempt %s cannot be used (%s): the agents coordinate through the "
                        "run folder", attempt, error)
            if server is not None:
                server.stop()
            return None
        return cls(client, address, server, attempt, job_id)

    @property
    def usable(self) -> bool:
        return not self.client.broken

    def environment(self) -> dict[str, str]:
        return self.address.environment()

    def notice(self, in_place: int) -> RestartNotice | None:
        """The restart notice the coordinator pushed, from memory: no file and no message."""
        value = self.client.known.get(restart_key(self.attempt, in_place))
        return notice_from(value, in_place) if value is not None else None

    def successor(self) -> str | None:
        value = self.client.known.get(handover_key(self.job_id))
        return str(value) if isinstance(value, str) and value.isdigit() else None

    def lost(self) -> tuple[int, list[str], list[str]]:
        """How many agents vanished without a bye (their node lost, or killed), the last eight of them, and the
        nodes of every one (members named ``node-K@NODE``)."""
        value = self.client.known.get(GONE_KEY)
        if not isinstance(value, dict):
            return 0, [], []
        count, names, nodes = value.get("lost"), value.get("names"), value.get("nodes")
        return ((count if isinstance(count, int) else 0), [str(n) for n in names] if isinstance(names, list) else [],
                [str(n) for n in nodes] if isinstance(nodes, list) else [])

    def gone(self) -> int:
        """How many agents left or vanished (their node lost) during this attempt: one key, pushed once a round
        however many went; the barrier's value names them."""
        value = self.client.known.get(GONE_KEY)
        count = value.get("count") if isinstance(value, dict) else 0
        return count if isinstance(count, int) else 0

    def request(self, run_dir: Path, notice: RestartNotice) -> RestartNotice:
        """Set the notice unless another agent did first; the one that holds is recorded in the run folder."""
        held = self.client.set(restart_key(self.attempt, notice.in_place), asdict(notice), first=True)
        holding = notice_from(held, notice.in_place) or notice
        if holding == notice:
            request_restart(run_dir, self.attempt, notice, publish_it=False)
        return holding

    def meet(self, key: str, member: str, expected: int, timeout_s: float, stopping: Any) -> dict[str, Any] | None:
        """Arrive at barrier ``key`` and wait until every expected agent arrived or is gone; the barrier's value
        (``arrived``, ``gone``), or None when the coordinator went away, the time ran out or ``stopping()``."""
        self.client.arrive(key, member, expected)
        deadline = time.monotonic() + timeout_s
        while (value := self.client.wait_for(key, 0.2)) is None:
            if self.client.broken:  # every agent lost it with rank 0's node: all go on through the files
                raise ControlError("the coordinator went away during a barrier")
            if time.monotonic() > deadline or stopping():
                return None
        return value if isinstance(value, dict) else None

    def barrier(self, in_place: int, member: str, agents: int, timeout_s: float, stopping: Any) -> str | None:
        """Restart ``in_place``'s barrier of a job without spares: None once every node's agent ended its ranks
        (one arrival per node), else why the ranks cannot start again here (an agent gone, the coordinator gone,
        the time out)."""
        try:
            value = self.meet(ready_key(self.attempt, in_place), member, agents, timeout_s, stopping)
        except ControlError:
            return "the coordinator is gone (node 0 lost?)"
        if value is None:
            return f"not every node's agent ended its ranks within {timeout_s:.0f} s (a node lost?)"
        gone = [str(name) for name in value.get("gone", [])]
        if gone:
            return f"the agent of {', '.join(gone[:8])} is gone (its node lost, or its ranks ended for good)"
        return None

    def assignment(self, in_place: int) -> Any:
        """Life ``in_place``'s assignment of ranks to nodes (a job with spares), as pushed; None until made."""
        return self.client.known.get(assignment_key(self.attempt, in_place))

    def propose(self, in_place: int, assignment: dict[str, Any]) -> Any:
        """Make life ``in_place``'s assignment unless another agent did first; the one that holds."""
        return self.client.set(assignment_key(self.attempt, in_place), assignment, first=True)

    def ranks_left(self) -> bool:
        """Whether the ranks left for good (a job with spares: the spares leave with them)."""
        return self.client.known.get(left_key(self.attempt)) is not None

    def say_left(self) -> None:
        with contextlib.suppress(ControlError):
            self.client.set(left_key(self.attempt), {"time": time.time()})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.client.close()
        if self.server is not None:
            self.server.stop()
