"""Benchmarks whose ranks are copies of the script on this machine: a free port, and the ranks started and
waited for (``--port`` and ``--rank`` added to each copy's arguments)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BlockSteps", "free_port", "join_gloo_pair", "run_blocks", "run_ranks"]


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for a rendezvous started right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_ranks(script: str, args: Sequence[str], count: int = 2, timeout_s: float = 900) -> None:
    """``script`` run as ``count`` ranks with ``args``. A rank that fails, or a run past ``timeout_s``, ends the
    others (they would wait in a collective for it) and a SystemExit naming the exit statuses."""
    command = [sys.executable, script, *args, "--port", str(free_port())]
    ranks = [subprocess.Popen([*command, "--rank", str(rank)]) for rank in range(count)]
    deadline = time.monotonic() + timeout_s
    try:
        while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
            if any(rank.returncode for rank in ranks):
                break
            time.sleep(0.1)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()
    codes = [rank.returncode for rank in ranks]
    if any(codes):
        raise SystemExit(f"a rank failed or ran past {timeout_s:.0f} s: exit statuses {codes}")


@dataclass(frozen=True)
class BlockSteps:
    """What a rank of a block benchmark is told: who it is, where to meet, and how many blocks of how many steps."""

    rank: int
    port: int
    blocks: int
    steps: int


def run_blocks(description: str, script: str, rank_main: Callable[[BlockSteps], None], blocks: int) -> None:
    """The command line of a benchmark of alternating blocks of steps on two local ranks (``--blocks``,
    ``--steps``, ``--smoke`` for 2 blocks of 5): the machine's line, then ``rank_main`` in two copies of
    ``script``."""
    from hpc_train.bench.machine import machine

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=blocks, help="blocks of each kind")
    parser.add_argument("--steps", type=int, default=50, help="steps a block")
    parser.add_argument("--smoke", action="store_true", help="2 blocks of 5 steps")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks, steps = (2, 5) if args.smoke else (args.blocks, args.steps)
    if args.rank is not None:
        rank_main(BlockSteps(args.rank, args.port, blocks, steps))
        return
    print(machine().line(), flush=True)
    run_ranks(script, ["--blocks", str(blocks), "--steps", str(steps)])


def join_gloo_pair(told: BlockSteps) -> Callable[[], None]:
    """This process as ``told.rank`` of two gloo ranks, one thread each (the two share this machine's cores); the
    step the block benchmarks time: 40 products of 384 x 384 matrices (about 25 ms on this machine)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(told.port))
    dist.init_process_group("gloo", rank=told.rank, world_size=2)
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def step() -> None:
        for _ in range(40):
            a @ b

    return step
