"""What the integrations share: the run context when hpc_train started this process, and what a library logs
as the plain numbers ``ctx.log`` takes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["scalars", "started_context"]


def started_context() -> Any:
    """``hpc_train.context()`` on a rank hpc_train started; None elsewhere (the same script under plain
    ``torchrun`` or ``python``), where an integration does nothing."""
    from hpc_train.rank.program.context import context, current_session

    return context() if current_session() is not None else None


def scalars(values: Mapping[str, Any], skip: tuple[str, ...] = ()) -> dict[str, float]:
    """Every value that is one finite number (a Python number, a one-element tensor or array), by its name;
    anything else (strings, lists, ``epoch``-like bookkeeping in ``skip``) is left out."""
    found: dict[str, float] = {}
    for name, value in values.items():
        if name in skip or isinstance(value, bool):
            continue
        number = value
        if hasattr(value, "numel") and callable(value.numel):
            if value.numel() != 1:
                continue
            number = value.detach().float().item() if hasattr(value, "detach") else value.item()
        elif hasattr(value, "item") and getattr(value, "size", 2) == 1:
            number = value.item()
        if isinstance(number, int | float) and math.isfinite(number):
            found[str(name).replace("/", "_")] = float(number)
    return found
