"""Each rank's small state (its random generators) saved in one file per node: ``rng/ranks-FIRST-LAST.pt``.

Why: a file per rank in every checkpoint is 16,384 files created on the metadata server per save at 16,384 ranks,
for a few kilobytes each. The ranks of node K of the layout (ranks ``K*T .. K*T+T-1``) hand their state to the
node's first rank over a gloo group of the node's ranks alone (made once, by its members only: no rank of another
node takes part), which writes them as one file ``{"RANK": state}``; the file's name says which ranks it holds,
so a rank finds its own again among the names the checkpoint's manifest lists, at any later layout with the same
tasks per node.

Each state travels as ``torch.save`` bytes and is read back with ``weights_only=True`` on the node's first rank,
so the file loads as every checkpoint file does. The gather runs on CPU tensors of a gloo group whatever the
training backend is (NCCL's collectives need CUDA tensors; these states are CPU tensors and numbers).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.rank.distributed.collectives import gather_bytes
from hpc_train.run.files import folder_names
from hpc_train.run.node_span import span_name, span_of

__all__ = ["NodeStates", "node_file_name", "rank_state_name"]



def node_file_name(rank: int, per_node: int) -> str:
    """``ranks-4-7.pt``: the file of the node that holds ``rank`` when ``per_node`` ranks share a node."""
    return span_name("ranks", rank, per_node, ".pt")


def rank_state_name(names: Iterable[str], rank: int) -> str | None:
    """The file among ``names`` (a listing of ``rng/``) that holds ``rank``: a node's, or ``rank-N.pt`` as older
    versions wrote it; None when no file holds it (a rank that did not exist at the save)."""
    names = list(names)
    if f"rank-{rank}.pt" in names:
        return f"rank-{rank}.pt"
    for name in names:
        if (held := span_of(name, "ranks", ".pt")) is not None and rank in held:
            return name
    return None


class NodeStates:
    """The node's states gathered on its first rank (:meth:`gather`), and a rank's own found again (:meth:`pick`)."""

    def __init__(self, rank: int, world: int, per_node: int, timeout_s: float = 1800.0) -> None:
        per_node = max(1, min(per_node, world))
        self.timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.first = rank - rank % per_node
        self.ranks = list(range(self.first, min(self.first + per_node, world)))
        self.file_name = node_file_name(rank, per_node)
        self._group: Any = None

    @property
    def leads(self) -> bool:
        """Whether this rank writes its node's file."""
        return self.rank == self.first

    def gather(self, make_state: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``{"RANK": state}`` of every rank of this node (each from its ``make_state()``), on its first rank; None
        on the others. A collective of the node's ranks: each of them calls it at the same point of the save. A
        rank whose ``make_state`` fails still takes part (with nothing), then raises: no peer is left waiting in
        the gather, and the save fails on that rank as any failed write does."""
        build = self.gather_later(make_state)
        return None if build is None else build()

    def gather_later(self, make_state: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]] | None:
        """:meth:`gather`, with the received bytes read back into states only when the returned function is called:
        by the writer thread of an asynchronous save, off the training thread (reading a state back takes about
        1 ms, on the first rank once per rank of its node)."""
        failure: Exception | None = None
        try:
            data = _to_bytes(make_state())
        except Exception as error:
            failure, data = error, b""
        if len(self.ranks) == 1 or not dist.is_initialized():
            if failure is not None:
                raise failure
            return lambda: {str(self.rank): _from_bytes(data)}
        received = gather_bytes(data, self.first, self._node_group())
        if failure is not None:
            raise failure
        if received is None:
            return None
        return lambda: {str(rank): _from_bytes(part) for rank, part in zip(self.ranks, received, strict=True) if part}

    def _node_group(self) -> Any:
        """The node's ranks as a gloo group, made by them alone (``use_local_synchronization``): 4,096 nodes do not
        each wait for the 4,095 others' groups."""
        if self._group is None:
            self._group = dist.new_group(self.ranks, timeout=self.timeout, backend="gloo",
                                         use_local_synchronization=True)
        return self._group

    def pick(self, folder: os.PathLike[str] | str, load: Callable[[str], Any], rank: int | None = None,
             names: Iterable[str] | None = None) -> dict[str, Any] | None:
        """This rank's state (or ``rank``'s) from the files in ``folder`` (``load(path)`` reads one, checked), or
        None when no file holds it: a rank new since the save keeps its freshly seeded generators. ``names``: the
        files the checkpoint's manifest lists there (no listing of the folder by every rank at a resume, and
        no file the manifest does not vouch for); None lists the folder."""
        rank = self.rank if rank is None else rank
        if names is None:
            names = folder_names(folder)  # never through a link: a planted rng/ holds no state of this run
        name = rank_state_name(names, rank)
        if name is None:
            return None
        found = load(os.path.join(folder, name))
        if name.startswith("rank-"):
            return found if isinstance(found, dict) else None
        mine = found.get(str(rank)) if isinstance(found, dict) else None
        return mine if isinstance(mine, dict) else None


def _to_bytes(state: dict[str, Any]) -> bytes:
    sink = io.BytesIO()
    torch.save(state, sink)
    return sink.getvalue()


def _from_bytes(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)
