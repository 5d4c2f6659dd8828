"""Text from configs, run folders and Slurm made safe to show: no control codes, no rich markup.

A key, a job id or a checkpoint path can come from someone else's file, and a path, a job name or an unknown
option is typed by the user (a paste can carry an escape sequence). Printed raw, an escape sequence rewrites the
terminal (its title, the screen, a fake prompt) and rich reads ``[/]`` or ``[link=...]`` as markup (a crash, or a
link that shows other text). Every value a command shows goes through :func:`shown` (for rich: a ``Text``, never
parsed as markup) or :func:`plain` (for ``print``; ``one_line=True`` for an error, which is one line whatever the
user typed into it).

``--json`` output goes through :func:`print_json`: strict JSON (RFC 8259) that any parser reads, never
``NaN`` or ``Infinity``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["UNSAFE_IN_LINE", "UNSAFE_IN_TEXT", "json_text", "plain", "print_json", "ranges", "shown"]

# The one definition of what never reaches a terminal, a script or a file unescaped: C0 control characters (but
# tab and newline), DEL, C1, the Unicode line and paragraph separators, the direction marks, the bidirectional
# overrides and isolates (they make a terminal show text in another order than it runs), and the BOM.
UNSAFE_IN_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
# The same, and tab and newline too: for a value that must stay one line (anything that reaches a script).
UNSAFE_IN_LINE = re.compile(f"[\t\n]|{UNSAFE_IN_TEXT.pattern}")


def plain(value: object, one_line: bool = False) -> str:
    """``str(value)`` with every control character written as its escape (``\\x1b``), for ``print``.

    ``one_line``: tab and newline too (``\\n``), for an error message: a newline typed into a path or a ``--set``
    value would otherwise start a second line that reads like the program's own (``error: ...``, a prompt)."""
    unsafe = UNSAFE_IN_LINE if one_line else UNSAFE_IN_TEXT
    return unsafe.sub(lambda m: repr(m.group())[1:-1], str(value))


def shown(value: object) -> Text:
    """:func:`plain` as a rich ``Text``, for ``console.print`` and table cells: a Text is never read as markup
    (``[/]``, ``[link=...]``) or emoji codes (``:smile:``)."""
    from rich.text import Text

    return Text(plain(value))


def ranges(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``: 16,384 failed ranks are a line no one reads (and rich takes a second to lay
    out); the same ranks as ranges are a few characters."""
    values = sorted(set(numbers))
    parts: list[str] = []
    start = prev = None
    for value in [*values, None]:
        if value is not None and prev is not None and value == prev + 1:
            prev = value
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = value
    return ",".join(parts)


def _finite(value: Any) -> Any:
    """``value`` with every NaN and infinity (at any depth of dicts, lists and tuples) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_finite_key(key): _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _finite_key(key: Any) -> Any:
    return str(key) if isinstance(key, float) and not math.isfinite(key) else key


def json_text(data: Any, indent: int | None = 2, sort_keys: bool = False,
              default: Callable[[Any], Any] | None = None) -> str:
    """``data`` as strict JSON: a float that is not finite (a loss of NaN, an infinite rate read from a damaged
    record) is ``null``, as JSON has no other word for it. Python's ``json.dumps`` writes ``NaN`` by default, which
    ``jq`` and most parsers refuse; ``allow_nan=False`` makes a value the walk missed (a ``default`` that returns
    one) fail here rather than print something that is not JSON. Nothing is said about the nulls: a reader of
    ``--json`` asked for data, and null is how JSON says "no number"."""
    return json.dumps(_finite(data), indent=indent, sort_keys=sort_keys, allow_nan=False,
                      default=None if default is None else lambda value: _finite(default(value)))


def print_json(data: Any, indent: int | None = 2, sort_keys: bool = False,
               default: Callable[[Any], Any] | None = None, flush: bool = False) -> None:
    """The one printer of ``--json`` output: :func:`json_text` on stdout, one document per call."""
    print(json_text(data, indent=indent, sort_keys=sort_keys, default=default), file=sys.stdout, flush=flush)
