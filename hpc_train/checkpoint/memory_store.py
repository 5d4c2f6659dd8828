"""A node's memory tier (``[checkpoint] memory_every_steps``): the ranks' states held in host memory that outlives
their processes, in a folder of the node's shared memory (``/dev/shm``) that the node's agent creates, owns and
removes.

Why files in ``/dev/shm`` rather than the agent's own heap: a rank writes its state there at memory speed and reads
it back the same way, with DeepSpeed's own save and load (which find files by name) and no copy through a socket;
the pages stay when the rank's process dies, and go when the agent removes the folder at its end. A node's folder
is read only by the ranks of that node and by its agent: another node's copy (a replica) arrives over the agents'
TCP connection (:mod:`hpc_train.checkpoint.memory_transfer`), never through a shared path.

The layout, per agent::

    /dev/shm/hpc_train-UID/JOB-NODE-PID-XXXX/  0700, created by the agent, removed by it
        own/rank-R/step-S.L/                rank R's state at step S, written by rank R in life L on this node
        own/rank-R/.step-S.L-XXXX/          ... while being written (renamed when whole: the seal)
        replica/rank-R/step-S.L/            another node's rank R, pushed by that node's agent
        fetched/rank-R/step-S.L/            a rank of this node's state fetched from another node at a restart

A copy is named by its step and the life that wrote it (``retry.in_place``'s count): a life that resumed from an
older step trains the steps after it again, and on a GPU not always to the same bits, so a step copied by some
ranks in one life and by others in the next is not one state; a restart takes a (step, life) that every rank
holds. Each sealed folder holds ``files.json`` (every file's size and sha256, checked when read back).
Torch-free: the agent imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.run.host_memory import available_memory

__all__ = ["FILES_NAME", "KEPT_STEPS", "MEMORY_ADDRESS_ENV", "MEMORY_DIR_ENV", "SHM_ROOT", "Copy", "NodeStore",
           "StoreError", "available_memory", "common_step", "copy_name", "read_files_list", "remove_stale_stores",
           "why_memory_tier_off", "write_files_list"]

MEMORY_DIR_ENV = "HPC_TRAIN_MEMORY_DIR"  # set by the agent on its ranks: this node's folder
MEMORY_ADDRESS_ENV = "HPC_TRAIN_MEMORY_ADDRESS"  # host:port of this node's agent's memory server
SHM_ROOT = Path("/dev/shm")  # noqa: S108 (checked: a private folder of ours below it, never a link)
FILES_NAME = "files.json"
KEPT_STEPS = 3  # per rank and kind: the newest steps, so that a replica a copy behind still meets the others
KINDS = ("own", "replica", "fetched")
_STEP = re.compile(r"step-(\d{1,15})\.(\d{1,6})")
Copy = tuple[int, int]  # (step, life)


def copy_name(copy: Copy) -> str:
    """A sealed copy's folder name: ``step-S.L``."""
    return f"step-{copy[0]}.{copy[1]}"


class StoreError(Exception):
    """The node's memory folder cannot be used (not ours, a link, not private): the tier stays off."""


def _private_folder(path: Path, create: bool) -> None:
    """``path`` is a real folder (never a link), ours, and no one else's to read or write; created 0700 if
    ``create``. ``/dev/shm`` is world-writable: another user could have planted a link or a folder there first."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise StoreError(f"{path} is not a folder (a link or a file planted there?): the memory tier stays off")
    if info.st_uid != os.getuid():
        raise StoreError(f"{path} belongs to uid {info.st_uid}, not to you: the memory tier stays off (remove it)")
    if info.st_mode & 0o077:
        raise StoreError(f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): the memory tier "
                         "stays off (chmod 700 it)")


@dataclass(frozen=True)
class NodeStore:
    """One agent's folder of rank states (see the module's docstring)."""

    root: Path

    @classmethod
    def create(cls, job_id: str, node: int, base: Path = SHM_ROOT) -> NodeStore:
        """The agent's new folder below ``base`` (``/dev/shm``), private, named after the job, the node and the
        agent's pid (so that a later agent can tell a dead agent's folder: :func:`remove_stale_stores`)."""
        if not base.is_dir():
            raise StoreError(f"{base} does not exist on this node: the memory tier stays off")
        user = base / f"hpc_train-{os.getuid()}"
        _private_folder(user, create=True)
        name = f"{re.sub(r'[^0-9A-Za-z_]', '_', job_id)[:40]}-{node}-{os.getpid()}-{secrets.token_hex(4)}"
        root = user / name
        os.mkdir(root, 0o700)
        return cls(root)

    @classmethod
    def opened(cls, path: str) -> NodeStore:
        """A rank's view of its agent's folder (:data:`MEMORY_DIR_ENV`), checked as the agent made it."""
        root = Path(path)
        if not root.is_absolute():
            raise StoreError(f"{MEMORY_DIR_ENV}={path!r} is not an absolute path")
        _private_folder(root.parent, create=False)
        _private_folder(root, create=False)
        return cls(root)

    def rank_dir(self, kind: str, rank: int) -> Path:
        return self.root / kind / f"rank-{rank}"

    def begin(self, kind: str, rank: int, copy: Copy) -> Path:
        """A new folder for rank ``rank``'s ``copy`` (step, life), to be filled then :meth:`seal`-ed."""
        folder = self.rank_dir(kind, rank)
        # never parents=True: a folder removed at the agent's end is not made again by a late request
        for level in (folder.parent, folder):
            with contextlib.suppress(FileExistsError):
                os.mkdir(level, 0o700)
        tmp = folder / f".{copy_name(copy)}-{secrets.token_hex(4)}"
        os.mkdir(tmp, 0o700)
        return tmp

    def seal(self, tmp: Path, copy: Copy) -> Path:
        """The copy is whole: its folder takes its name. A sealed folder of that name is never replaced (a copy
        pushed or fetched twice is the same bytes, and a reader may be in it): the new one is dropped."""
        final = tmp.parent / copy_name(copy)
        try:
            os.rename(tmp, final)
        except OSError:  # ENOTEMPTY / EEXIST: sealed meanwhile by another request
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def steps(self, kind: str, rank: int) -> list[Copy]:
        """The sealed copies (step, life) of rank ``rank`` of ``kind``, newest first."""
        try:
            names = os.listdir(self.rank_dir(kind, rank))
        except OSError:
            return []
        return sorted(((int(m[1]), int(m[2])) for n in names if (m := _STEP.fullmatch(n))), reverse=True)

    def ranks(self, kind: str) -> list[int]:
        try:
            names = os.listdir(self.root / kind)
        except OSError:
            return []
        return sorted(int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit())

    def holdings(self) -> dict[int, list[Copy]]:
        """Every rank this node holds a sealed copy of (its own ranks', replicas, fetched), with the copies."""
        held: dict[int, set[Copy]] = {}
        for kind in KINDS:
            for rank in self.ranks(kind):
                held.setdefault(rank, set()).update(self.steps(kind, rank))
        return {rank: sorted(steps, reverse=True) for rank, steps in held.items() if steps}

    def find(self, rank: int, copy: Copy) -> Path | None:
        """The sealed folder of rank ``rank``'s ``copy`` on this node, or None."""
        for kind in KINDS:
            folder = self.rank_dir(kind, rank) / copy_name(copy)
            if folder.is_dir() and not folder.is_symlink():
                return folder
        return None

    def prune(self, kind: str, rank: int, keep: int = KEPT_STEPS) -> None:
        """Keep the ``keep`` newest sealed copies of the rank; the rest go."""
        folder = self.rank_dir(kind, rank)
        for copy in self.steps(kind, rank)[keep:]:
            shutil.rmtree(folder / copy_name(copy), ignore_errors=True)

    def clear_unsealed(self, kind: str, rank: int) -> None:
        """Folders a rank of an earlier life left half written (it died while writing)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.rank_dir(kind, rank)):
                if name.startswith(".step-"):
                    shutil.rmtree(self.rank_dir(kind, rank) / name, ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def write_files_list(folder: Path, entries: list[dict[str, Any]]) -> None:
    """``files.json`` of a step folder: every file's path, size and sha256."""
    descriptor = os.open(folder / FILES_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        json.dump({"files": entries}, out)


def read_files_list(folder: Path) -> list[dict[str, Any]]:
    """The entries of a sealed step folder's ``files.json``; [] when it is missing or unreadable."""
    try:
        value = json.loads((folder / FILES_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    files = value.get("files") if isinstance(value, dict) else None
    return [f for f in files if isinstance(f, dict)] if isinstance(files, list) else []


def why_memory_tier_off(config: Any, tensor: int, pipeline: int) -> str:
    """Why ``[checkpoint] memory_every_steps`` does nothing for this job ("" where it works): the agents and the
    ranks decide alike from the plan, so every rank copies at the same steps or none does."""
    if config.checkpoint.memory_every_steps <= 0:
        return "checkpoint.memory_every_steps = 0"
    if config.retry.in_place < 1:
        return "retry.in_place = 0: memory outlives a rank only inside the job, and only a restart in place reads it"
    if not config.checkpoint.resume:
        return "checkpoint.resume = false"
    if config.job.program != "train" or config.train.engine != "deepspeed":
        return "only the built-in DeepSpeed trainer copies its state into memory (a program or FSDP2: the disk)"
    if config.retry.shrink:
        return "retry.shrink: a smaller life has another data-parallel size, at which a copy does not load"
    if tensor > 1 or pipeline > 1:
        return "tensor or pipeline parallel: each rank's DeepSpeed files do not load alone (the disk)"
    return ""


def remove_stale_stores(base: Path = SHM_ROOT) -> list[str]:
    """Remove this user's folders left by agents that died without removing them (a ``kill -9``, a crash): their
    pid is no longer alive on this node. Returns the names removed."""
    user = base / f"hpc_train-{os.getuid()}"
    try:
        _private_folder(user, create=False)
        names = os.listdir(user)
    except (OSError, StoreError):
        return []
    removed = []
    for name in names:
        parts = name.split("-")
        if len(parts) < 4 or not parts[-2].isdigit():
            continue
        pid = int(parts[-2])
        try:
            os.kill(pid, 0)
            continue  # alive (perhaps another job's agent on this node)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(user / name, ignore_errors=True)
        removed.append(name)
    return removed


def common_step(held: dict[int, set[Copy]], world: int) -> tuple[Copy | None, list[int]]:
    """The newest copy (step, life) every rank ``0..world-1`` has somewhere, and the ranks that have none in
    common (empty when one is found); ``held``: each rank's copies on any node."""
    missing = [rank for rank in range(world) if not held.get(rank)]
    if missing:
        return None, missing
    steps = set.intersection(*(held[rank] for rank in range(world)))
    if not steps:
        newest = max(held.values(), key=max)
        return None, [rank for rank in range(world) if max(newest) not in held[rank]]
    return max(steps), []
