"""Text from files is shown as typed: control codes escaped, rich markup and emoji codes left as text; ``--json``
output is strict JSON."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console
from rich.table import Table

from hpc_train.common.terminal import json_text, plain, print_json, shown


def test_control_codes_are_written_as_escapes_and_text_stays() -> None:
    assert plain("a\x1b]0;pwned\x07b\x9b2J\u202ec") == "a\\x1b]0;pwned\\x07b\\x9b2J\\u202ec"
    assert plain("two\nlines\tand tab") == "two\nlines\tand tab"


def test_one_line_escapes_newlines_and_tabs_too() -> None:
    """An error is one line whatever the user typed into it: a newline in a path cannot fake a second message."""
    assert plain("job.toml\nerror: fake\t\x1b[2J", one_line=True) == "job.toml\\nerror: fake\\t\\x1b[2J"


def _strict(text: str) -> object:
    def refuse(constant: str) -> float:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_output_maps_nan_and_infinity_to_null_at_any_depth() -> None:
    data = {"loss": math.nan, "rates": [1.5, math.inf, (-math.inf, 2)], "nested": {"x": {"y": [math.nan]}},
            math.inf: 1, "big": 10**400, "ok": 0.5}
    parsed = _strict(json_text(data))
    assert parsed == {"loss": None, "rates": [1.5, None, [None, 2]], "nested": {"x": {"y": [None]}},
                      "inf": 1, "big": 10**400, "ok": 0.5}


def test_json_output_checks_what_default_returns_too(capsys: object) -> None:
    class Odd:
        pass

    assert _strict(json_text({"odd": Odd()}, default=lambda value: math.nan)) == {"odd": None}
    print_json({"a": math.nan}, indent=None)
    assert capsys.readouterr().out == '{"a": null}\n'  # type: ignore[attr-defined]


def test_markup_and_emoji_codes_are_shown_literally() -> None:
    out = io.StringIO()
    table = Table()
    table.add_column("value")
    for value in ("[/]", "[link=http://evil]click[/link]", ":pile_of_poo:", "[bold]x"):
        table.add_row(shown(value))
    Console(file=out, width=80).print(table)
    text = out.getvalue()
    assert "[/]" in text and "[link=http://evil]click[/link]" in text and ":pile_of_poo:" in text
