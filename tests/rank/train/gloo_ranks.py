"""Two real gloo ranks in spawned processes, for the tests of one rank's measurements across ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def two_gloo_ranks(target: Callable[[int, str, str], None], tmp_path: Path) -> list[dict[str, Any]]:
    """Run ``target(rank, store_path, out_path)`` on ranks 0 and 1; each writes a JSON object to its out path."""
    context = mp.get_context("spawn")
    outs = [tmp_path / f"rank-{rank}.json" for rank in range(2)]
    processes = [context.Process(target=target, args=(rank, str(tmp_path / "store"), str(outs[rank])))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    return [json.loads(out.read_text()) for out in outs]
