"""Text from configs, run folders and Slurm made safe to show: no control codes, no rich markup.

A key, a job id or a checkpoint path can come from someone else's file. Printed raw, an escape sequence
rewrites the terminal (its title, the screen, a fake prompt) and rich reads ``[/]`` or ``[link=...]`` as
markup (a crash, or a link that shows other text). Every value a command shows goes through :func:`shown`
(for rich: a ``Text``, never parsed as markup) or :func:`plain` (for ``print``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["UNSAFE_IN_LINE", "UNSAFE_IN_TEXT", "plain", "ranges", "shown"]

# The one definition of what never reaches a terminal, a script or a file unescaped: C0 control characters (but
# tab and newline), DEL, C1, the Unicode line and paragraph separators, the direction marks, the bidirectional
# overrides and isolates (they make a terminal show text in another order than it runs), and the BOM.
UNSAFE_IN_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
# The same, and tab and newline too: for a value that must stay one line (anything that reaches a script).
UNSAFE_IN_LINE = re.compile(f"[\t\n]|{UNSAFE_IN_TEXT.pattern}")


def plain(value: object) -> str:
    """``str(value)`` with every control character written as its escape (``\\x1b``), for ``print``."""
    return UNSAFE_IN_TEXT.sub(lambda m: repr(m.group())[1:-1], str(value))


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
