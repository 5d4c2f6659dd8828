"""The errors a rank raises when a *peer* went away (it crashed, its node died, it left on a stop): symptoms of
another rank's failure, never a failure of the rank that shows them. The failure classes read them (such a rank
is not the cause) and so does the follower (it waits for the cause before it cancels anything)."""

from __future__ import annotations

import re

__all__ = ["PEER_LOST", "lost_its_peer"]

PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ncclRemoteError|"
                       r"remote process exited|NCCL communicator was aborted|Some NCCL operations have failed|"
                       r"DistNetworkError|failed to recv, got 0 bytes|ProcessGroup\w* .*abort", re.IGNORECASE)


def lost_its_peer(error: str) -> bool:
    """Whether ``error`` (an exception's repr or traceback) only says that another rank went away."""
    return PEER_LOST.search(error) is not None
