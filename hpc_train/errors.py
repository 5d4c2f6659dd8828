"""User-facing errors: one message naming the thing, the value and the fix; exit status 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "did_you_mean"]


class ConfigError(ValueError):
    """A mistake in the user's input (config, site, command line).

    The CLI prints ``str(error)`` and exits with status 2; nothing is submitted or written.
    """

    def __init__(self, where: str, problem: str, fix: str = "") -> None:
        self.where = where
        self.problem = problem
        self.fix = fix
        message = f"{where}: {problem}" if where else problem
        if fix:
            message += ("" if message.endswith(("?", ".")) else ".") + f" Fix: {fix}"
        super().__init__(message)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``'did you mean "x"?'`` for the closest valid choice, or ``''`` if none is close."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f'did you mean "{close[0]}"?' if close else ""
