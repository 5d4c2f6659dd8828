"""``model.json`` in the run folder: what ``ckpt export`` needs to know of the model that was trained, which it
cannot learn from DeepSpeed's files without importing the user's code.

* ``model``, ``class``, ``tied``: the ``train.model`` entry, the module's class, and the weights it ties.
* ``tensor_parallel``: ``split_dims``, the dimension along which each tensor-parallel parameter is cut across the
  tensor group (only sharded ones; every other parameter is whole on each tensor rank), ``shapes``, the full
  (merged) shape of every parameter, and ``unknown``: parameters marked sharded (``mark_sharded``) whose
  dimension is not known. Names are the checkpoint's: ``named_parameters()`` of the module, ``"<layer>.<name>"``
  for a pipeline. Found by walking the modules: ColumnParallelLinear cuts its weight and bias along dim 0,
  RowParallelLinear its weight along dim 1 (bias whole), VocabParallelEmbedding its table along dim 0; another
  parameter marked sharded that carries a ``partition_dim`` (Megatron's attribute) is cut along it. A
  pipeline's layers on other stages are built on the meta device (no memory, no collective) to be walked.
* ``gpt_config``: for the built-in GPT, its :class:`~hpc_train.rank.train.model.GPTConfig`, so an export can rebuild it
  (:func:`hpc_train.rank.train.exported.load_exported`).
* ``hf_config``: for a Hugging Face model (a module with a ``config`` that has ``to_dict`` and a
  ``save_pretrained``), its config as ``config.json`` of a ``save_pretrained`` folder holds it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hpc_train.config.job import MODEL_PRESETS
from hpc_train.run.files import atomic_write
from hpc_train.run.paths import MODEL_FILE

__all__ = ["GPT_FIELDS", "describe_model", "split_dims", "write_model_card"]

GPT_FIELDS = ("vocab_size", "seq_len", "layers", "heads", "hidden")  # hpc_train.rank.train.model.GPTConfig


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


def _module_splits(module: Any, prefix: str, dims: dict[str, int], shapes: dict[str, list[int]],
                   unknown: list[str]) -> None:
    """Add the sharded parameters of ``module`` (names prefixed with ``prefix``) to ``dims``, ``shapes``,
    ``unknown``."""
    from hpc_train.rank.distributed.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    known: dict[int, int] = {}  # id(param) -> dim, from the layer that owns it
    for sub in module.modules():
        if isinstance(sub, ColumnParallelLinear):
            known.update({id(p): 0 for p in (sub.weight, sub.bias) if p is not None})
        elif isinstance(sub, RowParallelLinear):
            known[id(sub.weight)] = 1
        elif isinstance(sub, VocabParallelEmbedding):
            known[id(sub.weight)] = 0
    for name, param in module.named_parameters():
        dim = known.get(id(param))
        if dim is None and getattr(param, "tensor_model_parallel", False):
            dim = getattr(param, "partition_dim", None)
            if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < param.dim():
                unknown.append(prefix + name)
                continue
        if dim is None:
            shapes[prefix + name] = list(param.shape)
            continue
        dims[prefix + name] = dim
        size = _tensor_size(module, param)
        if size is not None:
            shapes[prefix + name] = [n * size if axis == dim else n for axis, n in enumerate(param.shape)]


def _tensor_size(module: Any, param: Any) -> int | None:
    """The tensor-parallel size the layer that owns ``param`` was built for (its ``tp_size``), if it says."""
    for sub in module.modules():
        if any(p is param for p in sub.parameters(recurse=False)):
            size = getattr(sub, "tp_size", None)
            return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None
    return None


def _layers(model: Any) -> list[tuple[str, Any]]:
    """``(prefix, module)`` to walk: the model itself, or each layer of a DeepSpeed ``PipelineModule`` (its
    ``LayerSpec`` built on the meta device)."""
    specs = getattr(model, "_layer_specs", None)
    if not isinstance(specs, list):
        return [("", model)]
    import torch

    layers = []
    for index, spec in enumerate(specs):
        if isinstance(spec, torch.nn.Module):
            layers.append((f"{index}.", spec))
        elif callable(getattr(spec, "build", None)):
            with torch.device("meta"):
                layers.append((f"{index}.", spec.build()))
        else:
            raise TypeError(f"pipeline layer {index} is a {type(spec).__name__}, not a module or a LayerSpec")
    return layers


def split_dims(model: Any) -> dict[str, Any]:
    """``{"split_dims": {name: dim}, "shapes": {name: full shape}, "unknown": [name]}`` for ``model``."""
    dims: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    unknown: list[str] = []
    for prefix, module in _layers(model):
        _module_splits(module, prefix, dims, shapes, unknown)
    return {"split_dims": dims, "shapes": shapes, "unknown": unknown}


def _gpt_config(model: Any) -> dict[str, int] | None:
    """The built-in GPT's shape: ``model.config``, or the config a pipeline's first layer was built from."""
    candidates = [getattr(model, "config", None)]
    for spec in getattr(model, "_layer_specs", None) or []:
        candidates += list(getattr(spec, "module_args", ()))
    for config in candidates:
        if dataclasses.is_dataclass(config) and all(hasattr(config, name) for name in GPT_FIELDS):
            return {name: int(getattr(config, name)) for name in GPT_FIELDS}
    return None


def describe_model(model: Any, entry: str) -> dict[str, Any]:
    """The card of ``model`` (built from ``train.model = entry``)."""
    card: dict[str, Any] = {"model": entry, "class": f"{type(model).__module__}.{type(model).__qualname__}",
                            "tied": _tied_keys(model)}
    try:
        card["tensor_parallel"] = split_dims(model)
    except Exception as error:  # the card never stops a training; export refuses tensor > 1 with this
        card["tensor_parallel"] = {"error": f"{type(error).__name__}: {error}"}
    if entry in MODEL_PRESETS and (gpt := _gpt_config(model)) is not None:
        card["gpt_config"] = gpt
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)) and callable(getattr(model, "save_pretrained", None)):
        hf = dict(config.to_dict())
        hf["architectures"] = [type(model).__name__]
        card["hf_config"] = hf
    return card


def write_model_card(run_dir: Path, model: Any, entry: str) -> None:
    """Rank 0 writes ``model.json`` (private, atomically) before the first step."""
    atomic_write(run_dir / MODEL_FILE, json.dumps(describe_model(model, entry), indent=2, default=str) + "\n")
