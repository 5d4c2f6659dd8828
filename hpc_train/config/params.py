"""``[params]``: the user's own values, passed to their program as ``ctx.params`` and never interpreted.

They travel in ``plan.json`` and ``config.toml``, so only what both carry unchanged is taken: strings,
booleans, numbers, arrays and tables (keys are strings). A TOML date or time would come back as a string or
not at all, so it is refused with the fix of quoting it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_params"]


def _check(value: Any, where: str) -> tuple[str, str, str] | None:
    if isinstance(value, bool | int | float | str):
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            bad = _check(item, f"{where}[{index}]")
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return where, f"has the key {key!r}, which is not a string", "use string keys"
            bad = _check(item, f"{where}.{key}")
            if bad:
                return bad
        return None
    kind = type(value).__name__
    fix = 'quote it: "2026-12-01"' if kind in ("datetime", "date", "time") else \
        "use a string, a number, true/false, an array or a table"
    return where, f"is a {kind} ({value!r}), which plan.json cannot carry as it is", fix


def check_params(table: dict[str, Any]) -> tuple[str, str, str] | None:
    """None when every value of the table is plain TOML data, else (the key below [params], problem, fix)."""
    return _check(table, "")
