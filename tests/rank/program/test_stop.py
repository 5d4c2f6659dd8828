"""``should_stop()``'s agreement with two real gloo ranks: however differently the ranks' loops run, and whichever
rank gets the signal, both return True at the same call; rounds thin out to about one per 0.1 s of a fast loop."""

from __future__ import annotations

import random
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_train.rank.program.stop import MAX_CALLS_PER_ROUND, StopAgreement


class _Recorder:
    def decide_stop(self, *_: Any) -> str:
        return "decided"


def _rank(rank: int, store_path: str, signal_at: int, signalled: int, sleep_s: float, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    watch = SimpleNamespace(received=0, received_at=None)
    plan = SimpleNamespace(signal="USR2", lead_seconds=60,
                           config=SimpleNamespace(preempt=SimpleNamespace(requeue=True, max_requeues=10)))
    agreement = StopAgreement(plan, watch, _Recorder(), lambda _line: None)  # type: ignore[arg-type]
    jitter = random.Random(rank)  # noqa: S311 - not a secret
    call = 0
    while not agreement.ask(call):
        call += 1
        if rank == signalled and call == signal_at:
            watch.received = 12  # SIGUSR2, as the handler records it
        time.sleep(sleep_s * jitter.random() * (1 + rank))
        assert call < 20_000, "never stopped"
    agreement.settle()
    Path(out).write_text(f"{call} {agreement.every}")
    dist.destroy_process_group()


@pytest.mark.parametrize(("signalled", "sleep_s", "fast"), [(1, 0.0, True), (0, 0.002, False)])
def test_both_ranks_stop_at_the_same_call(tmp_path: Path, signalled: int, sleep_s: float, fast: bool) -> None:
    outs = [tmp_path / f"rank-{rank}.txt" for rank in range(2)]
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank, args=(rank, str(tmp_path / "store"), 500, signalled, sleep_s,
                                                     str(outs[rank]))) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    (call0, every0), (call1, every1) = (map(int, out.read_text().split()) for out in outs)
    assert call0 == call1 >= 500  # the same call on both ranks, after the signal
    assert every0 == every1
    if fast:  # microseconds per call: rounds every MAX_CALLS_PER_ROUND calls, the signal seen within 2 rounds
        assert every0 == MAX_CALLS_PER_ROUND and call0 <= 500 + 3 * MAX_CALLS_PER_ROUND
    else:  # about 2-4 ms per call: a round every few tens of calls
        assert 10 <= every0 < MAX_CALLS_PER_ROUND
