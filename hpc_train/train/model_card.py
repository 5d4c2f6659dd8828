"""``model.json`` in the run folder: what ``ckpt export`` needs to know of the model that was trained, which it
cannot learn from DeepSpeed's files without importing the user's code.

For a Hugging Face model (a module with a ``config`` that has ``to_dict`` and a ``save_pretrained``): its
config, as ``config.json`` of a ``save_pretrained`` folder holds it, and the weights it ties (``lm_head.weight``
to the token embedding), which a safetensors file stores once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_train.run.files import atomic_write
from hpc_train.run.paths import MODEL_FILE

__all__ = ["describe_model", "write_model_card"]


def _tied_keys(model: Any) -> list[str]:
    """Names of parameters that are another parameter (tied), as the module's state dict lists them."""
    seen: dict[int, str] = {}
    tied = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            tied.append(name)
        else:
            seen[key] = name
    return tied


def describe_model(model: Any, entry: str) -> dict[str, Any]:
    """The card of ``model`` (built from ``train.model = entry``)."""
    card: dict[str, Any] = {"model": entry, "class": f"{type(model).__module__}.{type(model).__qualname__}",
                            "tied": _tied_keys(model)}
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)) and callable(getattr(model, "save_pretrained", None)):
        hf = dict(config.to_dict())
        hf["architectures"] = [type(model).__name__]
        card["hf_config"] = hf
    return card


def write_model_card(run_dir: Path, model: Any, entry: str) -> None:
    """Rank 0 writes ``model.json`` (private, atomically) before the first step."""
    atomic_write(run_dir / MODEL_FILE, json.dumps(describe_model(model, entry), indent=2, default=str) + "\n")
