"""A field helper that keeps each config key's help text and value check next to its default."""

from __future__ import annotations

import dataclasses
from typing import Any

from hpc_train.config.checks import Check, TableCheck

__all__ = ["option"]


def option(default: Any, help: str, check: Check | None = None, factory: bool = False,
           table_check: TableCheck | None = None) -> Any:
    """A dataclass field with a help text (for docs and ``--help``), an optional per-value check, and for a free
    table an optional check of the whole table."""
    metadata = {"help": help, "check": check, "table_check": table_check}
    if factory:
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
