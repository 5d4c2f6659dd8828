"""Watching a run from outside while it runs: the last step it logged, and the process of one local rank.

The end-to-end tests and the benchmarks both drive a real run and act at a step (send a signal to one rank,
time the save). They share these readers here, beside the layout they read, because a benchmark must not
import the tests; the package itself never needs them.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_train.run.paths import METRICS_FILE, SUBMITIT_DIR

__all__ = ["last_logged_step", "local_rank_pid"]


def last_logged_step(run_dir: Path) -> int:
    """The highest step in rank 0's ``metrics.jsonl`` (0 before the first record); a line rank 0 is still
    writing is skipped."""
    try:
        lines = (Path(run_dir) / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            steps.append(record["step"])
    return max(steps, default=0)


def local_rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the live rank ``rank`` of this run under submitit's local executor (its tasks run
    ``submitit.core._submit`` on the run's ``submitit/`` folder and carry their rank in the environment).

    A rank's forked children (data loader workers) carry the same command line and environment, and those of an
    attempt that just ended outlive it for a few seconds: the rank is the newest such process whose parent is
    not one of them (a signal sent to an old attempt's worker is lost)."""
    marker = str(Path(run_dir) / SUBMITIT_DIR).encode()
    found: dict[int, tuple[int, int]] = {}  # pid: (parent, start time)
    for entry in Path("/proc").iterdir():
        if not (entry.name.isascii() and entry.name.isdigit()):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if b"submitit.core._submit" not in cmdline or marker not in cmdline:
                continue
            env = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
            stat = (entry / "stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if env.get(b"SUBMITIT_LOCAL_GLOBALID") == str(rank).encode() and stat[0] not in ("Z", "X"):
            found[int(entry.name)] = (int(stat[1]), int(stat[19]))
    ranks = [pid for pid, (parent, _) in found.items() if parent not in found]
    return max(ranks, key=lambda pid: found[pid][1], default=None)
