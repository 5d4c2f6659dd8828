"""The rank's heap after set-up: garbage freed first, the rest out of the collector's reach, later cycles still
collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from hpc_train.rank.runtime.heap import freeze_imports, freeze_set_up


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    """A reference cycle nothing else reaches: only the collector frees it."""
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


def test_set_up_garbage_is_freed_before_the_freeze() -> None:
    was_enabled = gc.isenabled()
    gc.disable()  # the cycle is left for freeze_set_up to find, not collected on the way
    try:
        left = _cycle()
        assert left() is not None
        freeze_set_up()
    finally:
        if was_enabled:
            gc.enable()
    assert left() is None, "a cycle left by set-up must not be frozen for the whole run (a GPU tensor in it)"
    assert gc.get_freeze_count() > 0


def test_objects_alive_at_the_freeze_are_out_of_reach_and_later_cycles_still_collected() -> None:
    kept = _Node()
    freeze_set_up()
    assert gc.get_freeze_count() > 0
    assert not any(obj is kept for obj in gc.get_objects()), "frozen objects are in no generation a collection scans"
    later = _cycle()
    gc.collect()
    assert later() is None


def test_freeze_imports_freezes_without_collecting() -> None:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        left = _cycle()
        freeze_imports()
        assert left() is not None, "the standby's freeze does no collection"
    finally:
        if was_enabled:
            gc.enable()
    assert gc.get_freeze_count() > 0
