"""Restarts inside the allocation, as the run folder records them: the restart notice and the agents' barrier.

Why files: the ranks of a failed attempt may be dead, hung or blind to each other (their process group is broken),
but the run folder is shared by every node. The first agent (or rank) that knows the attempt must start again
writes the notice for restart ``k`` with ``O_EXCL``, so exactly one cause is recorded; every agent that sees it
ends its rank, says so with a ready marker, and starts the rank again once all ranks' markers are there. No torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_train.control.publish import publish
from hpc_train.run.files import read_record_text
from hpc_train.run.paths import HEARTBEAT_DIR, restart_notice_path, restart_ready_path

__all__ = [
    "IN_PLACE_ENV",
    "IN_PLACE_LEFT_ENV",
    "RestartNotice",
    "in_place_index",
    "in_place_left",
    "mark_ready",
    "notice_from",
    "read_notice",
    "ready_count",
    "ready_key",
    "request_restart",
    "restart_key",
]

IN_PLACE_ENV = "HPC_TRAIN_IN_PLACE"  # which in-place restart of the Slurm attempt a rank belongs to (0: the first)
IN_PLACE_LEFT_ENV = "HPC_TRAIN_IN_PLACE_LEFT"  # how many more the agent may make; absent: no agent runs the rank


@dataclass(frozen=True)
class RestartNotice:
    """Why the ranks start again: the rank and node that asked, the failure class and one line."""

    in_place: int
    rank: int
    host: str
    failure_class: str
    reason: str
    time: float


def in_place_index(env: Mapping[str, str]) -> int:
    """The in-place restart this process runs in (0 without an agent or before any restart)."""
    value = env.get(IN_PLACE_ENV, "0")
    return int(value) if value.isdigit() else 0


def in_place_left(env: Mapping[str, str]) -> int:
    """How many more in-place restarts the agent above this rank may make (0: none, or no agent at all)."""
    value = env.get(IN_PLACE_LEFT_ENV, "0")
    return int(value) if value.isdigit() else 0


def restart_key(attempt: str, in_place: int) -> str:
    """The coordinator's key for restart ``in_place`` of ``attempt`` (:mod:`hpc_train.control`)."""
    return f"{attempt}/restart/{in_place}"


def ready_key(attempt: str, in_place: int) -> str:
    """The coordinator's barrier of restart ``in_place``: set once every rank's agent ended its rank."""
    return f"{attempt}/ready/{in_place}"


def notice_from(value: object, in_place: int) -> RestartNotice | None:
    """A notice as the coordinator carries it (a JSON object), or None when it is not one."""
    if not isinstance(value, dict):
        return None
    try:
        fields = {k: value[k] for k in RestartNotice.__dataclass_fields__}
        return RestartNotice(**{**fields, "in_place": in_place})
    except (KeyError, TypeError):
        return None


def request_restart(run_dir: Path, attempt: str, notice: RestartNotice, publish_it: bool = True) -> RestartNotice:
    """Write the notice for restart ``notice.in_place`` unless another rank did first; the notice that holds.
    With ``publish_it``, a rank whose agent named a coordinator sets it there first (the agents hear it at once,
    and the coordinator says which notice holds); the file is the durable record, and the agents' fallback."""
    if publish_it:
        held = notice_from(publish(restart_key(attempt, notice.in_place), asdict(notice)), notice.in_place)
        if held is not None and held != notice:
            return held
    path = restart_notice_path(run_dir, attempt, notice.in_place)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return read_notice(run_dir, attempt, notice.in_place) or notice
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(asdict(notice)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return notice


def read_notice(run_dir: Path, attempt: str, in_place: int, settle_s: float = 1.0) -> RestartNotice | None:
    """The notice for restart ``in_place``, or None. A notice being written (empty for a moment) is read again
    for up to ``settle_s``; one that stays unreadable still counts, with an unknown cause."""
    path = restart_notice_path(run_dir, attempt, in_place)
    if path.is_symlink() or not path.exists():
        return None
    deadline = time.monotonic() + settle_s
    while True:
        try:
            data = json.loads(read_record_text(path))  # never through a link, bounded in size
            return RestartNotice(**{k: data[k] for k in RestartNotice.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                return RestartNotice(in_place, -1, "", "unknown", f"{path.name} could not be read", time.time())
            time.sleep(0.05)


def mark_ready(run_dir: Path, attempt: str, in_place: int, rank: int) -> None:
    path = restart_ready_path(run_dir, attempt, in_place, rank)
    (Path(run_dir) / HEARTBEAT_DIR).mkdir(mode=0o700, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def ready_count(run_dir: Path, attempt: str, in_place: int, world_size: int) -> int:
    return sum(1 for rank in range(world_size) if restart_ready_path(run_dir, attempt, in_place, rank).exists())
