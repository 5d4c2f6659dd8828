"""A rank's one-off word to its job's coordinator: a restart it asks for, the next job of a chain it made.

A rank does not hold a connection: events are rare, so it connects, sets one key and says bye. Where no agent
named a coordinator (the local executor, torchrun, mpirun) or it cannot be reached, nothing is published and
the caller's file in the run folder is the only word, as the agents' fallback reads it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from hpc_train.control.client import ControlClient, ControlError
from hpc_train.control.discovery import from_env

__all__ = ["publish"]


def publish(key: str, value: Any, first: bool = True, env: dict[str, str] | None = None) -> Any:
    """Set ``key`` on the coordinator this rank's agent named; the value that holds, or None when there is no
    coordinator to tell."""
    address = from_env(os.environ if env is None else env)
    if address is None:
        return None
    try:
        client = ControlClient.connect(address.host, address.port, address.token, f"pid-{os.getpid()}",
                                       timeout_s=5.0)
    except ControlError:
        return None
    try:
        return client.set(key, value, first=first)
    except ControlError:
        return None
    finally:
        with contextlib.suppress(OSError):
            client.close()
