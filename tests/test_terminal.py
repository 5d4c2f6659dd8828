"""Text from files is shown as typed: control codes escaped, rich markup and emoji codes left as text."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from hpc_train.terminal import plain, shown


def test_control_codes_are_written_as_escapes_and_text_stays() -> None:
    assert plain("a\x1b]0;pwned\x07b\x9b2J\u202ec") == "a\\x1b]0;pwned\\x07b\\x9b2J\\u202ec"
    assert plain("two\nlines\tand tab") == "two\nlines\tand tab"


def test_markup_and_emoji_codes_are_shown_literally() -> None:
    out = io.StringIO()
    table = Table()
    table.add_column("value")
    for value in ("[/]", "[link=http://evil]click[/link]", ":pile_of_poo:", "[bold]x"):
        table.add_row(shown(value))
    Console(file=out, width=80).print(table)
    text = out.getvalue()
    assert "[/]" in text and "[link=http://evil]click[/link]" in text and ":pile_of_poo:" in text
