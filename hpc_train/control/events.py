"""What a rank hears from its job's coordinator: the events every rank must see within a second (a hang, an
attempt's stop), pushed into memory instead of polled from the run folder once a second per rank.

One connection per rank process, opened on first use and shared by its watchers (the watchdog, the stop of a
program that never asks ``should_stop()``); it watches the ``rank/`` keys only. Where no agent named a
coordinator (the local executor, torchrun, mpirun) or it went away, :func:`rank_events` gives None and the
callers read the run folder's files as before: those are written at every event whatever happens here.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from hpc_train.control.client import ControlClient, ControlError
from hpc_train.control.discovery import Address, from_env

__all__ = ["RankEvents", "forget_broken", "hang_decision_key", "hang_key", "rank_events", "stop_key",
           "stop_request_key"]

PREFIX = "rank/"


def hang_key(attempt: str) -> str:
    return f"{PREFIX}hang/{attempt}"


def hang_decision_key(attempt: str) -> str:
    return f"{PREFIX}hang-decision/{attempt}"


def stop_key(attempt: str) -> str:
    return f"{PREFIX}stop/{attempt}"


def stop_request_key(attempt: str) -> str:
    return f"{PREFIX}stop-request/{attempt}"


class RankEvents:
    """A rank's watching connection: :meth:`seen` answers from memory; :meth:`set` publishes."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client

    @property
    def usable(self) -> bool:
        return not self.client.broken

    def seen(self, key: str) -> Any:
        return self.client.known.get(key)

    def set(self, key: str, value: Any, first: bool = False) -> Any:
        """The value that holds; None when the coordinator went away (the caller's file is the word then)."""
        try:
            return self.client.set(key, value, first=first)
        except ControlError:
            return None


_lock = threading.Lock()
_opened: dict[tuple[int, Address], RankEvents | None] = {}  # one per process and coordinator, made once
_CONNECT_S = 5.0  # a coordinator that does not answer within this is taken for gone: the files are read


def _forget_after_fork() -> None:
    """A forked child (a data loader worker) has no connection of its own, and must not inherit a held lock."""
    global _lock
    _lock = threading.Lock()
    _opened.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def forget_broken() -> None:
    """Forget the connections that broke or never came up, so that the next :func:`rank_events` connects again:
    a process that trains another life (a warm restart) would otherwise read the run folder's files for the rest
    of the job after one hiccup of the coordinator."""
    with _lock:
        broken = [key for key, events in _opened.items() if events is None or not events.usable]
        gone = [_opened.pop(key) for key in broken]
    for events in gone:
        if events is not None:
            with contextlib.suppress(ControlError, OSError):
                events.client.close()


def rank_events(env: dict[str, str] | None = None) -> RankEvents | None:
    """This process's connection to the coordinator its agent named, opened on first use; None without one (or
    once it broke: then the run folder's files are read). The connection is made outside the lock, so a watcher
    never waits on another's connect; two that race make one each and keep the first."""
    address = from_env(os.environ if env is None else env)
    if address is None:
        return None
    key = (os.getpid(), address)
    with _lock:
        known = key in _opened
        events = _opened.get(key)
    if not known:
        events = None
        with contextlib.suppress(ControlError, OSError):
            client = ControlClient.connect(address.host, address.port, address.token, f"pid-{os.getpid()}",
                                           timeout_s=_CONNECT_S, reply_s=2 * _CONNECT_S)
            client.watch(PREFIX)
            events = RankEvents(client)
        with _lock:
            if key in _opened and events is not None:
                events.client.close()  # another watcher was first
            events = _opened.setdefault(key, events)
    return events if events is not None and events.usable else None
