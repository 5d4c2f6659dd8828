"""A small TOML writer for the resolved config (tomllib reads only)."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["dumps"]


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    if isinstance(value, dict):  # a table inside an array: inline
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    """TOML bare keys are ASCII letters, digits, _ and - only; anything else is quoted (str.isalnum() is not)."""
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _table(name: str, table: dict[str, Any], lines: list[str]) -> None:
    lines.append(f"\n[{name}]")
    nested = []
    for key, value in table.items():
        if isinstance(value, dict):
            nested.append((key, value))
        elif value is not None:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, sub in nested:
        _table(f"{name}.{_key(key)}", sub, lines)


def dumps(data: dict[str, Any]) -> str:
    """Top-level scalars first, then tables, nested tables as ``[a.b.c]``; None values are left out."""
    top = [f"{_key(name)} = {_value(value)}" for name, value in data.items()
           if not isinstance(value, dict) and value is not None]
    lines: list[str] = []
    for name, table in data.items():
        if isinstance(table, dict):
            _table(_key(name), table, lines)
    return "\n".join(top + lines).lstrip("\n") + "\n"
