"""One ``metrics.jsonl`` record as a line, cheaply: a program that logs every step pays for it on every record
(:meth:`hpc_train.rank.runtime.monitor.Monitor.scalars`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["frozen_value", "json_number", "record_line"]


def frozen_value(value: Any) -> Any:
    """A logged value as it is now: a CPU tensor read (cheaper than a copy), a GPU tensor detached and copied
    (asynchronously: reading it would wait for the GPU on every step), a number as it is."""
    if getattr(value, "is_cpu", False):
        return float(value)
    detach = getattr(value, "detach", None)
    return detach().clone() if detach is not None else value


_LINE_TEMPLATES: dict[tuple[str, ...], str] = {}  # a record's names -> its line with {} for each value


def record_line(record: Mapping[str, Any]) -> str:
    """``json.dumps(record, allow_nan=False) + "\\n"`` for a ``ctx.log`` record (names that are Python identifiers,
    an int step, finite floats or None), the same text at a fraction of the cost: a program that logs every step
    pays it on every record, and its records have the same names each time, so the line's frame is made once.
    Anything else goes through ``json.dumps``."""
    values = []
    for value in record.values():
        if value is None:
            values.append("null")
        elif type(value) is float or type(value) is int:
            values.append(repr(value))
        else:
            return json.dumps(record, allow_nan=False) + "\n"
    names = tuple(record)
    template = _LINE_TEMPLATES.get(names)
    if template is None:
        if not all(name.isascii() and name.isidentifier() for name in names) or len(_LINE_TEMPLATES) > 256:
            return json.dumps(record, allow_nan=False) + "\n"
        template = _LINE_TEMPLATES[names] = "{{" + ", ".join(f'"{name}": {{}}' for name in names) + "}}\n"
    return template.format(*values)


def json_number(value: float | None) -> float | None:
    """Strict JSON has no NaN/Infinity (``jq`` and many readers reject them): non-finite values become null."""
    return value if value is not None and math.isfinite(value) else None
