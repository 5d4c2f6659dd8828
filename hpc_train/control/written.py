"""A rank's word that its part of an asynchronous checkpoint save is on disk, told to rank 0 over the coordinator.

Why: each rank's writer thread used to say so with a marker file (``.written/rank-N.json``, an atomic write: a
create, a rename, then an unlink when rank 0 sealed the save), 16,384 files created and removed on the metadata
server at every save at 16,384 ranks. Where the job has a coordinator, rank 0 watches ``save/written/`` on its own
connection and each rank sets its key once per save (one key per rank, overwritten by the next save, so the
coordinator holds at most one record per rank). Rank 0 says whether it watches when it opens the save (beside the
folder name it broadcasts anyway, an id of the save that each record carries: a folder's name comes back when
a step is saved again); a rank that cannot publish (no coordinator, a record too long for one message, the
connection gone) writes its marker file as before, and rank 0 reads both.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from hpc_train.control.client import ControlClient, ControlError
from hpc_train.control.discovery import from_env
from hpc_train.control.events import rank_events
from hpc_train.control.wire import MAX_LINE, WireError, encode

__all__ = ["WrittenWatch", "publish_written", "written_key"]

PREFIX = "save/written/"
_CONNECT_S = 5.0
_ROOM = 1024  # bytes of a message besides the record (op, key, id)


def written_key(rank: int) -> str:
    return f"{PREFIX}rank-{rank}"


def publish_written(rank: int, save: str, record: dict[str, Any], env: dict[str, str] | None = None) -> bool:
    """Tell rank 0 that ``rank``'s part of the save ``save`` (the id rank 0 gave it) is written (``record``: its
    files' entries, or its error); False when it could not be told (the caller writes the marker file then)."""
    events = rank_events(os.environ if env is None else env)
    if events is None:
        return False
    value = {"save": save, **record}
    try:
        if len(encode(value)) > MAX_LINE - _ROOM:
            return False  # one message holds at most MAX_LINE: the file has no such limit
    except WireError:
        return False
    return events.set(written_key(rank), value) is not None


class WrittenWatch:
    """Rank 0's connection that hears every rank's written record (``save/written/``), in memory."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client

    @classmethod
    def open(cls, env: dict[str, str] | None = None) -> WrittenWatch | None:
        """The watch, or None where the job has no coordinator or it does not answer (marker files, then)."""
        address = from_env(os.environ if env is None else env)
        if address is None:
            return None
        try:
            client = ControlClient.connect(address.host, address.port, address.token, f"written-{os.getpid()}",
                                           timeout_s=_CONNECT_S, reply_s=2 * _CONNECT_S)
        except (ControlError, OSError):
            return None
        try:
            client.watch(PREFIX)
        except ControlError:
            client.close()
            return None
        return cls(client)

    @property
    def usable(self) -> bool:
        return not self.client.broken

    def records(self, save: str, ranks: set[int], world: int) -> dict[int, dict[str, Any]]:
        """The records of ranks not in ``ranks`` that say they are of the save ``save`` (its id)."""
        found: dict[int, dict[str, Any]] = {}
        for key, value in list(self.client.known.items()):
            number = key[len(PREFIX) + len("rank-"):] if key.startswith(PREFIX + "rank-") else ""
            if not number.isdigit() or len(number) > 9 or not isinstance(value, dict):
                continue
            rank = int(number)
            if rank < world and rank not in ranks and value.get("save") == save:
                found[rank] = {name: item for name, item in value.items() if name != "save"}
        return found

    def close(self) -> None:
        with contextlib.suppress(ControlError, OSError):
            self.client.close()
