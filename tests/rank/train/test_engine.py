"""The engine refuses to train when DeepSpeed did not take hpc_train's data-parallel group (every trainer run
checks it; the layouts of tests/rank/train/test_trainer_layouts.py pass it with real groups)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpc_train.rank.train.engine import _check_groups


def test_a_data_parallel_world_other_than_the_layout_s_is_refused() -> None:
    _check_groups(SimpleNamespace(dp_world_size=1, data_parallel_group=None), 1, None)
    with pytest.raises(RuntimeError, match=r"group is ranks \[0\] \(1\), but the layout's data axis is 2 ranks"):
        _check_groups(SimpleNamespace(dp_world_size=1, data_parallel_group=None), 2, None)
