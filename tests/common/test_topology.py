"""Rank topology: coordinates, groups, orders and errors, for small and very large worlds (pure Python)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from hpc_train.common.topology import AXES, Topology
from hpc_train.login import main as hpc_main
from tests.conftest import REPO, call_cli

LAYOUTS = [(8, 2, 2, 1), (8, 1, 1, 1), (16, 2, 2, 2), (24, 2, 3, 1), (64, 4, 2, 2), (12, 3, 1, 2)]


@pytest.mark.parametrize(("world", "tp", "pp", "cp"), LAYOUTS)
@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-dp-cp-pp", "pp-dp-cp-tp", "dp-tp-pp-cp"])
def test_groups_partition_the_world_and_agree_with_coordinates(world: int, tp: int, pp: int, cp: int,
                                                              order: str) -> None:
    topo = Topology.build(world, tp=tp, pp=pp, cp=cp, order=order)
    assert topo.sizes["dp"] * tp * pp * cp == world
    for rank in range(world):
        assert topo.rank_of(**topo.coords(rank)) == rank
    for size in range(1, len(AXES) + 1):
        for axes in itertools.combinations(AXES, size):
            groups = topo.groups(*axes)
            flat = sorted(r for group in groups for r in group)
            assert flat == list(range(world))  # disjoint and complete
            expected = 1
            for axis in axes:
                expected *= topo.sizes[axis]
            for group in groups:
                assert len(group) == expected
                others = {tuple(v for a, v in topo.coords(r).items() if a not in axes) for r in group}
                assert len(others) == 1  # members differ only along the group's axes
                assert topo.group_of(group[-1], *axes) == group


def test_default_order_keeps_tensor_groups_on_consecutive_ranks() -> None:
    topo = Topology.build(16, tp=4, pp=2)
    assert topo.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert topo.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert topo.groups("pp") == [[r, r + 8] for r in range(8)]
    assert topo.coords(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}


def test_megatron_rank_math_for_a_large_world() -> None:
    """tp 8, pp 16, dp 128: a rank's tensor group is its block of 8; pipeline stages are world/16 apart."""
    topo = Topology.build(16384, tp=8, pp=16)
    assert topo.sizes["dp"] == 128
    rank = 12345
    assert topo.group_of(rank, "tp") == list(range(12344, 12352))
    assert topo.group_of(rank, "pp") == [rank % 1024 + 1024 * k for k in range(16)]
    assert len(topo.groups("dp")) == 128 and len(topo.groups("dp")[0]) == 128


def test_131072_ranks_build_every_group() -> None:
    topo = Topology.build(131072, tp=8, pp=16)
    assert sum(len(g) for axis in AXES for g in topo.groups(axis)) == 4 * 131072


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world": 6, "tp": 4}, "world size 6 is not divisible by tensor x context x pipeline = 4 x 1 x 1 = 4"),
    ({"world": 8, "tp": 2, "dp": 3}, "= 6, but the world size is 8; leave data out"),
    ({"world": 8, "order": "tp-dp-pp"}, "order 'tp-dp-pp' must name each of tp, cp, dp, pp once"),
    ({"world": 0}, "world = 0: sizes must be whole numbers >= 1"),
    ({"world": 8, "tp": True}, "tp = True: sizes must be whole numbers"),
])
def test_invalid_layouts_name_the_sizes_and_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        Topology.build(**kwargs)
    assert message in str(error.value)


def test_unknown_axis_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown axis 'ep'; valid axes are tp, cp, dp, pp"):
        Topology.build(4).groups("ep")


def test_validate_world_prints_any_size(tmp_path: Path) -> None:
    example = str(REPO / "examples" / "tiny_gpt.toml")
    result = call_cli(hpc_main.main, ["validate", example, "--world", "4096", "--set", "parallel.tensor=4",
                                      "--set", "parallel.pipeline=2", "--json"], tmp_path)
    assert result.code == 0, result.err
    assert '"dp": 512' in result.out and '"global_batch": 4096' in result.out
    bad = call_cli(hpc_main.main, ["validate", example, "--world", "6", "--set", "parallel.tensor=4"], tmp_path)
    assert bad.code == 2 and "--world: world size 6 is not divisible" in bad.err
    assert list(tmp_path.iterdir()) == []
