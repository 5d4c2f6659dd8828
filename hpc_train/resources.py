"""Where shipped templates and site configs live, in a checkout and in an installed wheel alike."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

__all__ = ["shipped_dir"]

_CHECKOUT = Path(__file__).resolve().parent.parent


def shipped_dir(kind: str) -> Path:
    """The folder of ``sbatch_templates`` or ``site_configs`` that came with this installation.

    The wheel maps both top-level folders into the package (``hpc_train.site_configs``); a plain checkout on
    ``PYTHONPATH`` has them beside the package.
    """
    if kind not in ("sbatch_templates", "site_configs"):
        raise ValueError(f"unknown resource folder {kind!r}")
    try:
        folder = importlib.resources.files(f"hpc_train.{kind}")
        path = Path(str(folder))
        if path.is_dir():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return _CHECKOUT / kind
