"""What a config file may hold at all: data that ``plan.json`` and ``config.toml`` both carry unchanged.

A job travels as JSON (the plan every rank reads) and as TOML (the run folder's copy), and its values reach
scripts and terminals. So, before any key is interpreted: no dates or times (JSON has none), no NaN or
infinity (not JSON), integers within TOML's 64 bits, no control characters in keys or values (a newline in a
key, an escape sequence for the terminal), and no nesting deeper than any real config needs (a 100,000-deep
array would exhaust the stack of every reader after us). The walk is iterative, so it cannot overflow itself.
"""

from __future__ import annotations

import datetime
import math
import re
from typing import Any

from hpc_train.common.terminal import UNSAFE_IN_LINE, UNSAFE_IN_TEXT
from hpc_train.config.secrets import secret_name, secret_value

__all__ = ["MAX_DEPTH", "MULTILINE_SECTIONS", "check_portable"]

MAX_DEPTH = 32
MAX_STRING = 65536
_INT_LIMIT = 2**63
_KEY = re.compile(r"[A-Za-z0-9_.+-]{1,128}")
# The free tables a user's program or DeepSpeed reads from plan.json: a multi-line string is data there, and it
# never reaches a script. Everywhere else a value is one line.
MULTILINE_SECTIONS = ("params", "deepspeed")


def _scalar_problem(value: Any, multiline: bool, name: str = "") -> tuple[str, str] | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if -_INT_LIMIT <= value < _INT_LIMIT:
            return None
        return f"{str(value)[:30]} does not fit in 64 bits", "use a smaller number"
    if isinstance(value, float):
        return None if math.isfinite(value) else (f"{value!r} is not a finite number", "write a number like 3e-4")
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            return f"is a string of {len(value):,} characters", f"keep values under {MAX_STRING:,} characters"
        bad = (UNSAFE_IN_TEXT if multiline else UNSAFE_IN_LINE).search(value)
        if bad:
            allowed = "a newline or tab is fine here, " if multiline else "one line, "
            excerpt = "" if secret_name(name) or secret_value(value) else f" ({value[:40]!r})"
            return (f"holds the control character {bad.group()!r}{excerpt}",
                    f"use plain text ({allowed}no escapes or control codes)")
        return None
    if isinstance(value, datetime.date | datetime.time):
        kind = type(value).__name__
        return f"is a {kind} ({value!r}), which plan.json cannot carry as it is", 'quote it: "2026-12-01"'
    return f"is a {type(value).__name__}", "use a string, a number, true/false, an array or a table"


def _key_problem(key: str) -> tuple[str, str] | None:
    if _KEY.fullmatch(key):
        return None
    return (f"the key {key[:60]!r} is not plain ASCII", "use keys of letters, digits and _ . + - (at most 128)")


def check_portable(data: dict[str, Any]) -> tuple[str, str, str] | None:
    """None when ``data`` is portable, else (the dotted key, the problem, the fix)."""
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        where, value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return (where.split(".")[0] or "(top)", f"nests deeper than {MAX_DEPTH} levels",
                    "flatten it; no setting needs that depth")
        if isinstance(value, dict):
            for key, item in value.items():
                bad = _key_problem(key) if isinstance(key, str) else ("a key is not a string", "use string keys")
                if bad:
                    return (where or "(top)", *bad)
                stack.append((f"{where}.{key}" if where else key, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{where}[{index}]", item, depth + 1) for index, item in enumerate(value))
        else:
            name = where.rpartition(".")[2].split("[")[0]
            bad = _scalar_problem(value, where.split(".")[0].split("[")[0] in MULTILINE_SECTIONS, name)
            if bad:
                return (where, *bad)
    return None
