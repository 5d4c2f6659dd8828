"""A small TOML writer for the resolved config (tomllib reads only)."""

from __future__ import annotations

import json
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
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dumps(data: dict[str, Any]) -> str:
    """Tables of scalars and lists (one level of nesting, or two for tables inside a section)."""
    lines: list[str] = []
    for name, table in data.items():
        if not isinstance(table, dict):
            lines.insert(0, f"{name} = {_value(table)}")
            continue
        lines.append(f"\n[{name}]")
        nested = []
        for key, value in table.items():
            if isinstance(value, dict):
                nested.append((key, value))
            elif value is not None:
                lines.append(f"{json.dumps(key) if not key.replace('_', '').isalnum() else key} = {_value(value)}")
        for key, sub in nested:
            lines.append(f"\n[{name}.{key}]")
            lines.extend(f"{sub_key} = {_value(sub_value)}" for sub_key, sub_value in sub.items())
    return "\n".join(lines).lstrip("\n") + "\n"
