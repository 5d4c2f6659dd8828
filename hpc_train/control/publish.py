"""A rank's one-off word to its job's coordinator: a restart it asks for, the next job of a chain it made.

A rank publishes over the one connection it holds to hear events (:mod:`hpc_train.control.events`). Where no
agent named a coordinator (the local executor, torchrun, mpirun) or it cannot be reached, nothing is published
and the caller's file in the run folder is the only word, as the agents' fallback reads it.
"""

from __future__ import annotations

import os
from typing import Any

from hpc_train.control.events import rank_events

__all__ = ["publish"]



def publish(key: str, value: Any, first: bool = True, env: dict[str, str] | None = None) -> Any:
    """Set ``key`` on the coordinator this rank's agent named, over the rank's one connection (opened on first
    use, :func:`~hpc_train.control.events.rank_events`); the value that holds, or None when there is no
    coordinator to tell or it does not answer (the caller's file, written first, is the word then)."""
    events = rank_events(os.environ if env is None else env)
    return events.set(key, value, first=first) if events is not None else None
