"""How the agents of a job find its coordinator: one private address file per Slurm attempt, written once.

The hosting agent binds a free port (no collision with another job's on a shared node), then writes host, port
and a fresh token to a file of the run folder that only the job's user can read (0600 in a 0700 folder, never
through a link); every other agent reads it once at its start. That is the only run-folder read the control
plane makes per agent, and it is not periodic. The token keeps other users' processes on the cluster out of the
job's decisions: without it a connection is closed at its first line.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CONTROL_ENV", "CONTROL_TOKEN_ENV", "Address", "find_address", "from_env", "new_token",
           "publish_address"]

CONTROL_ENV = "HPC_TRAIN_CONTROL"  # host:port of the job's coordinator, for a rank that publishes an event
CONTROL_TOKEN_ENV = "HPC_TRAIN_CONTROL_TOKEN"  # noqa: S105 (a variable name) its token (environment only: never in a script, plan or log)
_MAX_BYTES = 4096


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    token: str = field(repr=False)  # never in a log line, however the address is printed

    def environment(self) -> dict[str, str]:
        """What a rank needs to publish an event to the coordinator."""
        return {CONTROL_ENV: f"{self.host}:{self.port}", CONTROL_TOKEN_ENV: self.token}


def new_token() -> str:
    return secrets.token_hex(16)


def publish_address(path: Path, address: Address) -> None:
    """Write ``path`` whole (a private name, fsynced, renamed into place), readable by this user only."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    private = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        json.dump({"host": address.host, "port": address.port, "token": address.token}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(private, path)


def _read(path: Path) -> Address | None:
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO planted there never blocks
    except OSError:
        return None
    with contextlib.closing(os.fdopen(descriptor, "rb")) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None  # planted by someone else, or readable by others: not this job's
        try:
            data = json.loads(handle.read(_MAX_BYTES))
            host, port, token = data["host"], data["port"], data["token"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
    if not (isinstance(host, str) and isinstance(port, int) and 0 < port < 65536 and isinstance(token, str)):
        return None
    return Address(host, port, token)


def find_address(path: Path, timeout_s: float) -> Address | None:
    """The coordinator's address once its file is there; None after ``timeout_s``. The wait backs off to one
    look a second, and happens once per agent per Slurm attempt."""
    deadline, delay = time.monotonic() + timeout_s, 0.05
    while True:
        address = _read(path)
        if address is not None or time.monotonic() >= deadline:
            return address
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(1.0, delay * 2)


def from_env(env: dict[str, str] | os._Environ[str]) -> Address | None:
    """The coordinator the agent above this rank named, or None (no agent, or not a Slurm job)."""
    where, token = env.get(CONTROL_ENV, ""), env.get(CONTROL_TOKEN_ENV, "")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not token or not 0 < int(port) < 65536:
        return None
    return Address(host, int(port), token)
