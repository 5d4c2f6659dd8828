"""The built-in GPT back from a ``python -m hpc_train ckpt export`` file, for inference anywhere (one process, no
DeepSpeed, no run folder): :func:`load_exported`. The file's format (its description and tensors) is the
checkpoint room's (:mod:`hpc_train.checkpoint.exported`); torch and safetensors are imported inside the functions,
so ``import hpc_train.rank.train`` stays light."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.exported import EXPORT_FIX, GPT_CONFIG_KEY, MODEL_KEY, read_description, read_tensors
from hpc_train.errors import ConfigError

__all__ = ["load_exported"]


def _gpt_config(path: Path, description: dict[str, str]) -> Any:
    from hpc_train.rank.train.model import GPTConfig

    text = description.get(GPT_CONFIG_KEY)
    if text is None:
        raise ConfigError(str(path), f"is an export of train.model = {description.get(MODEL_KEY, '?')!r}, not of "
                          "the built-in GPT", "load it into your own module: model.load_state_dict("
                          "safetensors.torch.load_file(FILE)) or torch.load(FILE, weights_only=True)")
    try:
        return GPTConfig(**json.loads(text))
    except (ValueError, TypeError) as error:
        raise ConfigError(str(path), f"records a GPT config that cannot be read ({error})", EXPORT_FIX) from None


def load_exported(path: str | os.PathLike[str], device: Any = "cpu") -> Any:
    """The built-in GPT of an export (``--format safetensors`` or ``pt``, fp32 or bf16), whole in this process,
    its weights in the export's dtype on ``device``, in eval mode: ``model(tokens, targets)`` is the mean
    next-token loss. A pt file is read with ``torch.load(weights_only=True)``.

    ConfigError (a ValueError) naming the file and the fix for a file that is not an hpc_train export of the
    built-in GPT, or whose tensors do not fit the GPT it describes."""
    import torch
    import torch.distributed as dist

    from hpc_train.rank.train.model import GPT

    path = Path(path)
    description = read_description(path)
    config = _gpt_config(path, description)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(str(path), "load_exported builds the whole GPT in one process, but torch.distributed is "
                          "initialised with more than one rank (the GPT's layers would shard over them)",
                          "load it in a process without a process group, or destroy it first")
    with torch.device("meta"):  # no random init of weights that are replaced at once
        model = GPT(config, None)
    try:
        model.load_state_dict(read_tensors(path), strict=True, assign=True)
    except RuntimeError as error:
        raise ConfigError(str(path), f"does not fit the GPT its description records ({error})".replace("\n", " "),
                          EXPORT_FIX) from None
    return model.to(device).eval()
