"""The ranks one node's file holds, named in the file's name: ``PREFIX-FIRST-LAST.SUFFIX``.

One rule for every per-node file (the node's log ``ranks-0-3.log``, its error records ``errors-0-3.jsonl``, its
random states ``ranks-0-3.pt`` in a checkpoint): the ranks of node K of the layout are ``K*T .. K*T+T-1`` with
``T`` ranks a node, and a reader finds a rank's file from a listing alone. A name that claims more ranks than a
node runs is damage, not a node's file.
"""

from __future__ import annotations

import re

__all__ = ["MAX_RANKS_A_NODE", "span_name", "span_of"]

MAX_RANKS_A_NODE = 1 << 10  # job.tasks_per_node's bound
_SPAN = re.compile(r"([0-9]{1,9})-([0-9]{1,9})")


def span_name(prefix: str, rank: int, per_node: int, suffix: str) -> str:
    """``{prefix}-4-7{suffix}``: the file of the node that holds ``rank`` when ``per_node`` ranks share a node."""
    per_node = max(per_node, 1)
    first = rank - rank % per_node
    return f"{prefix}-{first}-{first + per_node - 1}{suffix}"


def span_of(name: str, prefix: str, suffix: str) -> range | None:
    """The ranks ``name`` says it holds when it is ``{prefix}-FIRST-LAST{suffix}``; None for any other name."""
    if not (name.startswith(f"{prefix}-") and name.endswith(suffix)):
        return None
    m = _SPAN.fullmatch(name[len(prefix) + 1:len(name) - len(suffix)])
    if m is None:
        return None
    first, last = int(m[1]), int(m[2])
    return range(first, last + 1) if first <= last and last - first < MAX_RANKS_A_NODE else None
