"""The coordinator section of benchmarks/control_plane.py: the job's coordinator (hpc_train.control) with emulated
agents on this machine, one per node as a job of N nodes runs (hpc_train.rank.agent: one agent per node, however many
ranks it starts).

Each emulated agent is what a real one does on the network (hpc_train.rank.agent.link): it connects with the
job's token, watches its attempt's keys and the lost ones, arrives at the start barrier, then waits for a restart
notice, arrives at the restart's barrier and waits for its decision. The agents run as threads in 16 worker
processes; the coordinator runs in this process, on its own thread, as in the first node's agent. Measured:

- start: from launching the workers to the start barrier decided (every agent connected and arrived);
- restart decision: from the notice being set to its barrier decided, and to the last agent hearing it;
- lost node: one worker (its agents: some nodes) killed at the restart; from the notice to the barrier decided,
  naming the lost agents (their connections dropped);
- messages: requests the coordinator served per agent for one restart.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import time
from dataclasses import dataclass
from typing import Any

from hpc_train.control.client import ControlClient
from hpc_train.control.server import ControlServer

WORKERS = 16
TOKEN = "benchmark-token"  # noqa: S105 (the benchmark's own coordinator, on the loopback)


@dataclass(frozen=True)
class Figures:
    nodes: int
    agents: int
    start_s: float
    decision_s: float
    heard_s: float
    lost_decision_s: float
    messages_per_agent: float


def _agent(port: int, name: str, attempt: str, expected: int, heard: list[tuple[int, float]]) -> None:
    client = ControlClient.connect("127.0.0.1", port, TOKEN, name, timeout_s=60, agent=True)
    for prefix in (f"{attempt}/", "gone"):
        client.watch(prefix)
    client.arrive(f"{attempt}/start", name, expected)
    for life in (1, 2):
        if client.wait_for(f"{attempt}/restart/{life}", 300) is None:
            break
        client.arrive(f"{attempt}/ready/{life}", name, expected)
        if client.wait_for(f"{attempt}/ready/{life}", 300) is not None:
            heard.append((life, time.monotonic()))
    client.close()


def _worker(port: int, names: list[str], expected: int, out: Any) -> None:
    import threading

    heard: list[tuple[int, float]] = []
    threads = [threading.Thread(target=_agent, args=(port, name, "b.0", expected, heard)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.send(heard)


def _wait_key(client: ControlClient, key: str, timeout_s: float = 600) -> float:
    if client.wait_for(key, timeout_s) is None:
        raise RuntimeError(f"{key} was not decided within {timeout_s:.0f} s")
    return time.monotonic()


def measure(nodes: int) -> Figures:
    """One job of ``nodes`` agents: start, a restart, then a restart with one worker's nodes lost."""
    agents = nodes
    server = ControlServer(TOKEN, host="127.0.0.1").start()
    watcher = ControlClient.connect("127.0.0.1", server.port, TOKEN, "benchmark")
    watcher.watch("b.0/")
    names = [f"node-{node}@n{node}" for node in range(agents)]
    workers = min(WORKERS, nodes)  # a worker holds whole nodes, so killing one loses nodes, not half of one
    per = [[n for n in names if int(n.split("@n")[1]) % workers == i] for i in range(workers)]
    context = multiprocessing.get_context("fork")
    pipes, procs = [], []
    started = time.monotonic()
    for chunk in per:
        ours, theirs = context.Pipe(duplex=False)
        proc = context.Process(target=_worker, args=(server.port, chunk, agents, theirs), daemon=True)
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    start_s = _wait_key(watcher, "b.0/start") - started
    before = server.messages
    first_notice = time.monotonic()
    watcher.set("b.0/restart/1", {"rank": 3, "why": "benchmark"}, first=True)
    decision_s = _wait_key(watcher, "b.0/ready/1") - first_notice
    messages = (server.messages - before) / agents
    time.sleep(0.5)  # every agent has heard the first decision before the second restart
    os.kill(procs[-1].pid, signal.SIGKILL)  # a worker's nodes lost: their agents' connections drop
    noticed = time.monotonic()
    watcher.set("b.0/restart/2", {"rank": 0, "why": "benchmark, a node lost"}, first=True)
    lost_s = _wait_key(watcher, "b.0/ready/2") - noticed
    gone = watcher.known["b.0/ready/2"]["gone"]
    if len(gone) != len(per[-1]):
        raise RuntimeError(f"the barrier named {len(gone)} lost agents, not {len(per[-1])}")
    heard: list[tuple[int, float]] = []
    for pipe, proc in zip(pipes[:-1], procs[:-1], strict=True):
        heard.extend(pipe.recv())
        proc.join(timeout=60)
    heard_s = max(t for life, t in heard if life == 1) - first_notice
    watcher.close()
    server.stop()
    return Figures(nodes, agents, start_s, decision_s, heard_s, lost_s, messages)


def coordinator_section(args: argparse.Namespace) -> list[Any]:
    from control_plane import Row  # the main script's row type (this module runs beside it)

    rows = []
    for nodes in args.nodes:
        runs = [measure(nodes) for _ in range(args.runs)]
        median = {field: statistics.median(getattr(r, field) for r in runs)
                  for field in ("start_s", "decision_s", "heard_s", "lost_decision_s", "messages_per_agent")}
        agents = runs[0].agents
        print(f"coordinator: {nodes} nodes, {agents} agents: start {median['start_s']:.3f} s, restart decided "
              f"{median['decision_s'] * 1000:.1f} ms after the notice (every agent heard it within "
              f"{median['heard_s'] * 1000:.1f} ms), with a node lost {median['lost_decision_s'] * 1000:.1f} ms; "
              f"{median['messages_per_agent']:.1f} requests per agent per restart", flush=True)
        for what, key in (("start to all agents ready", "start_s"), ("restart decided", "decision_s"),
                          ("restart decided, a node lost", "lost_decision_s")):
            rows.append(Row("coord", agents, what, median[key], 0.0, 0.0))
    return rows
