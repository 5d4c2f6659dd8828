"""Rank topology: which rank sits where along the tensor, context, data and pipeline axes.

Pure Python (no torch), so a login node can check and print a layout of any size, and tests can cover
hundreds of thousands of ranks. The order string lists axes innermost first; the default
``tp-cp-dp-pp`` keeps a tensor group on consecutive ranks, and so inside one node. Each rank's coordinate
along an axis is ``(rank // stride) % size``, where an axis' stride is the product of the sizes of the axes
inside it (the same rank math as Megatron-LM's ``RankGenerator``, held in an object, not in globals).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from math import prod

__all__ = ["AXES", "DEFAULT_ORDER", "Topology"]

AXES = ("tp", "cp", "dp", "pp")
AXIS_NAMES = {"tp": "tensor", "cp": "context", "dp": "data", "pp": "pipeline"}
DEFAULT_ORDER = "tp-cp-dp-pp"


@dataclass(frozen=True)
class Topology:
    """A world of ``world`` ranks laid out along named axes."""

    world: int
    sizes: dict[str, int]
    order: tuple[str, ...]

    @classmethod
    def build(cls, world: int, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None,
              order: str = DEFAULT_ORDER) -> Topology:
        """Check the sizes and derive ``dp`` (when not given) as world / (tp x cp x pp)."""
        names = tuple(order.split("-"))
        if sorted(names) != sorted(AXES):
            raise ValueError(f"order {order!r} must name each of {', '.join(AXES)} once, innermost first, "
                             f"like {DEFAULT_ORDER!r}")
        for name, size in (("world", world), ("tp", tp), ("pp", pp), ("cp", cp), ("dp", dp or 1)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} = {size!r}: sizes must be whole numbers >= 1")
        model = tp * cp * pp
        if dp is None:
            if world % model:
                raise ValueError(f"world size {world} is not divisible by tensor x context x pipeline = "
                                 f"{tp} x {cp} x {pp} = {model}; use a world size that is a multiple of {model}, "
                                 "or smaller model-parallel sizes")
            dp = world // model
        if model * dp != world:
            raise ValueError(f"tensor x context x data x pipeline = {tp} x {cp} x {dp} x {pp} = {model * dp}, "
                             f"but the world size is {world}; leave data out to derive it")
        return cls(world=world, sizes={"tp": tp, "cp": cp, "dp": dp, "pp": pp}, order=names)

    def stride(self, axis: str) -> int:
        """How far apart in rank two neighbours along ``axis`` are."""
        self._check_axis(axis)
        return prod(self.sizes[name] for name in self.order[: self.order.index(axis)])

    def coords(self, rank: int) -> dict[str, int]:
        """``{"tp": i, "cp": j, "dp": k, "pp": l}`` of ``rank``."""
        self._check_rank(rank)
        return {axis: (rank // self.stride(axis)) % self.sizes[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes are 0)."""
        rank = 0
        for axis, value in coords.items():
            self._check_axis(axis)
            if not 0 <= value < self.sizes[axis]:
                raise ValueError(f"{axis} = {value} is outside 0..{self.sizes[axis] - 1}")
            rank += value * self.stride(axis)
        return rank

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes`` (e.g. ``groups("dp", "cp")``), each sorted."""
        return list(self._iter_groups(axes))

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The group along ``axes`` that holds ``rank``."""
        coords = self.coords(rank)
        base = rank - sum(coords[axis] * self.stride(axis) for axis in axes)
        return sorted(base + offset for offset in self._offsets(axes))

    def _offsets(self, axes: tuple[str, ...]) -> list[int]:
        offsets = [0]
        for axis in axes:
            self._check_axis(axis)
            step = self.stride(axis)
            offsets = [o + k * step for o in offsets for k in range(self.sizes[axis])]
        return offsets

    def _iter_groups(self, axes: tuple[str, ...]) -> Iterator[list[int]]:
        offsets = sorted(self._offsets(axes))
        others = [axis for axis in AXES if axis not in axes]
        bases = [0]
        for axis in others:
            step = self.stride(axis)
            bases = [b + k * step for b in bases for k in range(self.sizes[axis])]
        for base in sorted(bases):
            yield [base + offset for offset in offsets]

    def _check_axis(self, axis: str) -> None:
        if axis not in self.sizes:
            raise ValueError(f"unknown axis {axis!r}; valid axes are {', '.join(AXES)}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside 0..{self.world - 1}")

    def summary(self, show: int = 2) -> list[tuple[str, str]]:
        """Rows for a layout table: sizes, order and the first groups of each axis."""
        rows = [("world", " x ".join(f"{AXIS_NAMES[a]} {self.sizes[a]}" for a in AXES) + f" = {self.world}"),
                ("order", "-".join(self.order) + " (innermost first)")]
        for axis in AXES:
            count = self.world // self.sizes[axis]
            first = list(islice(self._iter_groups((axis,)), show))
            text = "; ".join(_short(group) for group in first)
            rows.append((f"{AXIS_NAMES[axis]} groups", f"{count} of {self.sizes[axis]}: {text}"
                         + ("; ..." if count > show else "")))
        return rows


def _short(group: list[int], limit: int = 8) -> str:
    """A group as ``[0, 1, 2, 3]`` or ``[0, 8, 16, ..., 1016] (128 ranks)``."""
    if len(group) <= limit:
        return str(group)
    return f"[{group[0]}, {group[1]}, {group[2]}, ..., {group[-1]}] ({len(group)} ranks)"
