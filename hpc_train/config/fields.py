"""A field helper that keeps each config key's help text, value check and numeric range next to its default."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hpc_train.config.checks import Check, TableCheck

__all__ = ["Range", "option", "within"]


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take, ``low <= value <= high``. Every number of the schema has one
    (``tests/config/test_ranges.py`` walks it): a value beyond any machine or any run (a 19-digit node count,
    1e308 minutes) once went on into arithmetic and crashed a command or a rank with OverflowError, or was
    rendered into ``#SBATCH`` lines as it was. ``below``/``above`` replace the standard problems (formatted with
    ``value``, ``low``, ``high``) where a key has words of its own; ``fix`` replaces the standard fix."""

    low: float
    high: float
    below: str = ""
    above: str = ""
    fix: str = ""

    def problem(self, value: float) -> tuple[str, str] | None:
        """None when ``value`` is in range, else (problem, fix) naming the range."""
        if self.low <= value <= self.high:
            return None
        shown = str(value)
        words = {"value": shown if len(shown) <= 24 else shown[:21] + "...", "low": _bound(self.low),
                 "high": _bound(self.high)}
        template = (self.below or "{value} is below the minimum {low}") if value < self.low else \
            (self.above or "{value} is above the maximum {high}")
        return template.format(**words), (self.fix or "give a value from {low} to {high}").format(**words)


def within(low: int, high: int) -> Range:
    """A range whose message names both ends: numbers a library takes only between them (NCCL's)."""
    text = f"{{value}} is outside {low}..{high}"
    return Range(low, high, text, text, f"use a value from {low} to {high}")


def _bound(value: float) -> str:
    """A bound as people read it: 100,000 and 0.5."""
    return f"{value:,}" if isinstance(value, int) and abs(value) >= 10_000 else str(value)


def option(default: Any, help: str, check: Check | None = None, factory: bool = False,
           table_check: TableCheck | None = None, bounds: Range | None = None) -> Any:
    """A dataclass field with a help text (for docs and ``--help``), an optional per-value check, for a free
    table an optional check of the whole table, and for a number its range."""
    metadata = {"help": help, "check": check, "table_check": table_check, "range": bounds}
    if factory:
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
