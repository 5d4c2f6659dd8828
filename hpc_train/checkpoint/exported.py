"""The format of a ``python -m hpc_train ckpt export`` file, read back: its description and its tensors
(:func:`hpc_train.rank.train.exported.load_exported` builds the built-in GPT from them).

What an export carries besides its tensors (the writer is :mod:`hpc_train.checkpoint.export`, the reader here, so
both use the names below): a ``str -> str`` description, the safetensors file's own metadata, or for ``--format
pt`` (a plain ``dict`` of tensors, as ``torch.load(weights_only=True)`` wants it) a JSON sidecar beside the file,
``FILE.json``. It holds ``hpc_train.export`` (the description's version), ``hpc_train.model`` (``train.model``),
``hpc_train.dtype``, ``hpc_train.step`` and, for the built-in GPT, ``hpc_train.gpt_config`` (its
:class:`~hpc_train.rank.train.model.GPTConfig` as JSON).

torch and safetensors are imported inside the functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpc_train.errors import ConfigError
from hpc_train.run.files import open_record

__all__ = ["DTYPE_KEY", "EXPORT_FIX", "EXPORT_KEY", "EXPORT_VERSION", "GPT_CONFIG_KEY", "MODEL_KEY", "STEP_KEY",
           "read_description", "read_tensors", "sidecar_path"]

EXPORT_KEY, EXPORT_VERSION = "hpc_train.export", "1"
MODEL_KEY, DTYPE_KEY, STEP_KEY, GPT_CONFIG_KEY = "hpc_train.model", "hpc_train.dtype", "hpc_train.step", \
    "hpc_train.gpt_config"
EXPORT_FIX = "export the run again: python -m hpc_train ckpt export RUN --format safetensors --out model.safetensors"
_MAX_SIDECAR = 1 << 20


def sidecar_path(path: Path) -> Path:
    """The description beside a ``--format pt`` export: ``model.pt`` -> ``model.pt.json``."""
    return path.with_name(path.name + ".json")


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with the 8-byte length of its JSON header, then ``{``; a torch file is a zip."""
    with open(path, "rb") as handle:
        head = handle.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(path)


def _safetensors_description(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except Exception as error:  # safetensors raises its own SafetensorError for a bad header
        raise ConfigError(str(path), f"is not a readable safetensors file ({type(error).__name__}: {error})",
                          EXPORT_FIX) from None


def _sidecar_description(path: Path) -> dict[str, str]:
    side = sidecar_path(path)
    try:
        with open_record(side) as handle:  # never through a link, never blocking on a FIFO
            data = json.loads(handle.read(_MAX_SIDECAR).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(path), f"has no {side.name} beside it (the model description ckpt export writes "
                          "with --format pt)", f"keep the two files together, or {EXPORT_FIX}") from None
    except (OSError, ValueError) as error:
        raise ConfigError(str(side), f"cannot be read as the export's description ({error})", EXPORT_FIX) from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(str(side), "is not an export description (a JSON object of strings)", EXPORT_FIX)
    return data


def read_description(path: str | os.PathLike[str]) -> dict[str, str]:
    """The description of the export at ``path`` (safetensors metadata, or a pt file's sidecar); ConfigError
    naming the file and the fix when it is missing or is not an hpc_train export's."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "does not exist or is not a file", "give the path ckpt export wrote (--out)")
    description = _safetensors_description(path) if _is_safetensors(path) else _sidecar_description(path)
    if description.get(EXPORT_KEY) != EXPORT_VERSION:
        raise ConfigError(str(path), "is not an hpc_train export (its description has no "
                          f'"{EXPORT_KEY}": "{EXPORT_VERSION}")', EXPORT_FIX)
    return description


def read_tensors(path: Path) -> dict[str, Any]:
    """An export's tensors (safetensors, or a pt file through ``torch.load(weights_only=True)``); ConfigError naming
    the file when it cannot be read or is not a state dict."""
    import pickle

    import torch

    try:
        if _is_safetensors(path):
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise ConfigError(str(path), f"cannot be read ({type(error).__name__}: {error})".replace("\n", " "),
                          EXPORT_FIX) from None
    if not isinstance(state, dict):
        raise ConfigError(str(path), f"holds a {type(state).__name__}, not a state dict", EXPORT_FIX)
    return state
