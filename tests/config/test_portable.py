"""What a config may hold at all: data plan.json and config.toml both carry, checked without recursion."""

from __future__ import annotations

import datetime
import tomllib

import pytest

from hpc_train.config.portable import MAX_DEPTH, check_portable
from hpc_train.config.tomlwrite import dumps


@pytest.mark.parametrize(("data", "where", "said"), [
    ({"deepspeed": {"x": datetime.date(2026, 12, 1)}}, "deepspeed.x", "is a date"),
    ({"params": {"x": float("nan")}}, "params.x", "not a finite number"),
    ({"params": {"x": [1.0, float("inf")]}}, "params.x[1]", "not a finite number"),
    ({"job": {"nodes": 2**70}}, "job.nodes", "does not fit in 64 bits"),
    ({"params": {"été": 1}}, "params", "not plain ASCII"),
    ({"job": {"args": ["a\nb"]}}, "job.args[0]", "control character"),
    ({"params": {"x": "a\x1b]0;pwned\x07"}}, "params.x", "control character"),
    ({"env": {"X": "a\u202eb"}}, "env.X", "control character"),
])
def test_what_json_and_toml_cannot_both_carry_is_named(data: dict, where: str, said: str) -> None:
    bad = check_portable(data)
    assert bad is not None and bad[0] == where and said in bad[1], bad


def test_multi_line_text_is_data_in_params_and_deepspeed_only() -> None:
    assert check_portable({"params": {"prompt": "line 1\n\tline 2"}, "deepspeed": {"x": "a\nb"}}) is None


def test_nesting_is_limited_without_exhausting_the_stack() -> None:
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    bad = check_portable({"params": {"x": deep}})
    assert bad is not None and f"deeper than {MAX_DEPTH}" in bad[1]


def test_what_is_portable_reads_back_from_config_toml_unchanged() -> None:
    data = {"params": {"a-b": 1, "x.y": "z", "list": [{"k": 1}, {"k": 2}]}, "deepspeed": {"foo": [{"a": 1}]}}
    assert check_portable(data) is None
    assert tomllib.loads(dumps(data)) == data
