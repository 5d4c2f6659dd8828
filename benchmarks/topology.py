"""Topology at scale: every group of every axis for 16,384 and 131,072 ranks, against a brute-force baseline.

    .venv/bin/python benchmarks/topology.py [--smoke]

The baseline is the obvious code: compute every rank's coordinates, then bucket ranks by their other
coordinates (what a per-rank loop over a dict does). Targets: under 1 s for 16,384 ranks, 10 s for 131,072.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from hpc_train.common.topology import AXES, Topology

LAYOUTS = {"16,384 ranks (tp 8, pp 16, dp 128)": (16384, 8, 16), "131,072 ranks (tp 8, pp 16, dp 1024)":
           (131072, 8, 16)}
SMOKE_LAYOUTS = {"64 ranks (tp 2, pp 4, dp 8)": (64, 2, 4), "512 ranks (tp 8, pp 16, dp 4)": (512, 8, 16)}


def ours(world: int, tp: int, pp: int) -> int:
    topology = Topology.build(world, tp=tp, pp=pp)
    return sum(len(group) for axis in AXES for group in topology.groups(axis))


def brute_force(world: int, tp: int, pp: int) -> int:
    dp = world // (tp * pp)
    sizes = {"tp": tp, "cp": 1, "dp": dp, "pp": pp}
    coords = []
    for rank in range(world):
        rest, coord = rank, {}
        for axis in AXES:
            coord[axis] = rest % sizes[axis]
            rest //= sizes[axis]
        coords.append(coord)
    total = 0
    for axis in AXES:
        buckets: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for rank, coord in enumerate(coords):
            buckets[tuple(v for a, v in coord.items() if a != axis)].append(rank)
        total += sum(len(group) for group in buckets.values())
    return total


def _median_time(function: object, *args: int, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        assert function(*args) == 4 * args[0]  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny layouts, one repetition: the benchmark runs "
                        "end to end in a second (CI), its figures mean nothing")
    args = parser.parse_args()
    layouts, runs = (SMOKE_LAYOUTS, 1) if args.smoke else (LAYOUTS, 3)
    print(f"{'layout':38} {'hpc_train s':>12} {'brute force s':>14} {'ratio':>6} {'target':>7}")
    for name, (world, tp, pp) in layouts.items():
        mine = _median_time(ours, world, tp, pp, runs=runs)
        base = _median_time(brute_force, world, tp, pp, runs=runs)
        target = 1.0 if world <= 16384 else 10.0
        print(f"{name:38} {mine:12.3f} {base:14.3f} {mine / base:6.2f} {'met' if mine < target else 'MISSED':>7}")


if __name__ == "__main__":
    main()
