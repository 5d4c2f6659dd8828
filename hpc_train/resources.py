"""Where shipped templates and site configs live, in a checkout and in an installed wheel alike."""

from __future__ import annotations

from pathlib import Path

__all__ = ["shipped_dir"]

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(kind: str) -> Path:
    """The folder of ``sbatch_templates`` or ``site_configs`` that came with this installation.

    A wheel maps both top-level folders into the package (``hpc_train/site_configs``); a checkout, plain or
    installed editable, has them beside the package.
    """
    if kind not in ("sbatch_templates", "site_configs"):
        raise ValueError(f"unknown resource folder {kind!r}")
    for candidate in (_PACKAGE / kind, _PACKAGE.parent / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"hpc_train is installed without its {kind} folder; reinstall the package")
