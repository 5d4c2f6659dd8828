"""A DeepSpeed user's ``ds_config.json`` as the job's config: ``[train] deepspeed_config = "ds_config.json"``.

The keys hpc_train models become the typed keys they mean (the micro batch, accumulation, global batch, clipping,
the number format, the ZeRO stage and offload, AdamW's settings), so the checks, the plan and the memory estimate
see them; every other key passes through to DeepSpeed as a ``[deepspeed]`` table does, ``steps_per_print`` and
the scheduler included: DeepSpeed builds its own scheduler, so a ``WarmupLR`` warms up and holds as DeepSpeed
means it (its warm-up and peak are also read into ``train.warmup_steps`` and ``train.lr`` for the plan's checks).
The job file and the JSON must agree: a key both set to different values is refused, naming the key in the
file; ``--set`` on the command line wins over both (how a CPU trial runs a GPU file in fp32). Pure Python: the
login node reads the file before anything is submitted.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.config.deepspeed import check_scheduler
from hpc_train.config.ds_semantics import check_semantics
from hpc_train.config.portable import MAX_DEPTH, check_portable
from hpc_train.config.secrets import redact, shown_value
from hpc_train.errors import ConfigError

__all__ = ["PLAIN_KEYS", "Imported", "import_deepspeed_config", "imported_for", "merge_imported", "named_in_file"]

_MAX_BYTES = 1 << 20
_ADAM = ("adam", "adamw")
# DeepSpeed key path -> the typed key it means (values copied as they are)
PLAIN_KEYS: dict[tuple[str, ...], str] = {
    ("train_micro_batch_size_per_gpu",): "train.micro_batch",
    ("gradient_accumulation_steps",): "train.grad_accum",
    ("train_batch_size",): "train.global_batch",
    ("gradient_clipping",): "train.grad_clip",
    ("zero_optimization", "stage"): "zero.stage",
    ("zero_optimization", "overlap_comm"): "zero.overlap_comm",
    ("zero_optimization", "reduce_bucket_size"): "zero.bucket_size",
    ("optimizer", "params", "lr"): "train.lr",
    ("optimizer", "params", "eps"): "train.eps",
    ("optimizer", "params", "weight_decay"): "train.weight_decay",
    ("scheduler", "params", "warmup_num_steps"): "train.warmup_steps",
    ("scheduler", "params", "warmup_min_lr"): "train.min_lr",
}
# Read, and what they say is carried by typed keys (or is DeepSpeed's bookkeeping that the typed config sets)
_CONSUMED = {("optimizer", "type"), ("optimizer", "params", "betas"), ("fp16", "enabled"), ("bf16", "enabled"),
             ("zero_optimization", "offload_optimizer", "device"), ("zero_optimization", "offload_param", "device"),
             ("scheduler", "type"), ("scheduler", "params", "warmup_max_lr"), ("scheduler", "params",
                                                                                "total_num_steps")}


@dataclass
class Imported:
    """What the file says: typed values by ``section.key``, where each came from (``file: key``), and the keys that
    pass through to DeepSpeed as they are."""

    source: str = ""
    typed: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    passthrough: dict[str, Any] = field(default_factory=dict)
    redacted: list[str] = field(default_factory=list)  # keys whose credential is written as "<redacted>"
    auto: list[str] = field(default_factory=list)  # the keys the file gives as "auto" (the plan shows their values)


def _text(path: Path, shown: str) -> str:
    """The file's text, opened without blocking: a FIFO, a device, a folder or a huge file is refused unread."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError("train.deepspeed_config", f"{shown} does not exist",
                          "a relative path is taken from the job file's folder") from None
    except OSError as error:
        raise ConfigError("train.deepspeed_config", f"cannot open {shown} ({error.strerror or error})",
                          "point it at your ds_config.json") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_BYTES:
            raise ConfigError("train.deepspeed_config", f"{shown} is not a JSON file of at most 1 MiB",
                              "point it at your ds_config.json")
        raw = handle.read(_MAX_BYTES + 1)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(shown, "is not UTF-8 text", "save it as UTF-8") from None


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _read(path: Path, shown: str) -> dict[str, Any]:
    """The file's JSON object, strict (no NaN or Infinity), as deep and as large as a ``[deepspeed]`` table may
    be (:func:`hpc_train.config.portable.check_portable`): a 100,000-deep nesting once ended in RecursionError."""
    text = _text(path, shown)
    try:
        data = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ConfigError(shown, f"nests deeper than {MAX_DEPTH} levels", "flatten it; no DeepSpeed key needs that "
                          "depth") from None
    except ValueError as error:  # json.JSONDecodeError, NaN, an integer of more than 4,300 digits
        problem = "holds an integer of thousands of digits" if "digits" in str(error) else str(error)
        raise ConfigError(shown, f"is not valid JSON ({problem})", "fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(shown, "holds no JSON object", 'a DeepSpeed config is an object: {"zero_optimization": ...}')
    bad = check_portable({"deepspeed": data})
    if bad:
        key = bad[0].removeprefix("deepspeed").lstrip(".")
        raise ConfigError(f"{shown}: {key}" if key else shown, bad[1], bad[2])
    return data


def _flat(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, (*prefix, str(key))))
        else:
            out[(*prefix, str(key))] = value
    return out


def _nested(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def import_deepspeed_config(path: Path, shown: str) -> Imported:
    """Read ``path`` (``shown`` names it in messages) into typed values and the keys that pass through."""
    found = Imported(source=shown)
    data = redact(_read(path, shown), found=found.redacted)  # before anything reads a value, or says one
    flat = _flat(check_semantics(data, shown))
    found.auto = [".".join(key) for key, value in flat.items() if value == "auto"]

    def put(typed: str, value: Any, key: tuple[str, ...]) -> None:
        found.typed[typed] = value
        found.origin[typed] = f"{shown}: {'.'.join(key)}"

    for key, typed in PLAIN_KEYS.items():
        if key in flat and flat[key] != "auto":
            put(typed, flat[key], key)
    for key in flat:  # hpc_train builds the optimizer: a setting of its it cannot honour is refused
        if key[0] == "optimizer" and key not in PLAIN_KEYS and key not in _CONSUMED:
            raise ConfigError(f"{shown}: {'.'.join(key)}", "is a setting of DeepSpeed's optimizer, which hpc_train "
                              "builds itself (AdamW with train.lr, beta1, beta2, eps, weight_decay)",
                              "remove it, or set the train key it stands for")
    _optimizer(flat, put, shown)
    check_scheduler(data.get("scheduler"), f"{shown}: ")
    _precision(flat, put)
    for device_key, typed in ((("zero_optimization", "offload_optimizer", "device"), "zero.offload_optimizer"),
                              (("zero_optimization", "offload_param", "device"), "zero.offload_params")):
        if device_key in flat:
            put(typed, flat[device_key] == "cpu", device_key)
    if found.typed.get("zero.offload_optimizer"):
        put("train.optimizer", "cpu_adam", ("zero_optimization", "offload_optimizer", "device"))
    found.passthrough = _nested({k: v for k, v in flat.items() if (k[0] == "scheduler" or (k not in PLAIN_KEYS and
                                                                    k not in _CONSUMED))
                                 and k[:2] not in (("zero_optimization", "offload_optimizer"),
                                                   ("zero_optimization", "offload_param"))})
    return found


def _optimizer(flat: dict[tuple[str, ...], Any], put: Callable[[str, Any, tuple[str, ...]], None],
               shown: str) -> None:
    kind = flat.get(("optimizer", "type"))
    if kind is not None and str(kind).lower() not in _ADAM:
        raise ConfigError(f"{shown}: optimizer.type", f'"{str(kind)[:80]}" is not an optimizer hpc_train trains with',
                          'use "AdamW" (or "Adam"): hpc_train trains with AdamW and its weight-decay groups')
    betas = flat.get(("optimizer", "params", "betas"))
    if isinstance(betas, list) and len(betas) == 2:
        put("train.beta1", betas[0], ("optimizer", "params", "betas"))
        put("train.beta2", betas[1], ("optimizer", "params", "betas"))
    peak = flat.get(("scheduler", "params", "warmup_max_lr"))
    base = flat.get(("optimizer", "params", "lr"), "auto")
    if peak is not None and peak != "auto":
        if base != "auto" and base != peak:
            raise ConfigError(f"{shown}: scheduler.params.warmup_max_lr", f"= {shown_value(peak)} and "
                              f"optimizer.params.lr = {shown_value(base)} both give the peak learning rate "
                              "(train.lr), differently", "keep one of them, or make them equal")
        put("train.lr", peak, ("scheduler", "params", "warmup_max_lr"))


def _precision(flat: dict[tuple[str, ...], Any], put: Callable[[str, Any, tuple[str, ...]], None]) -> None:
    for name in ("fp16", "bf16"):
        if flat.get((name, "enabled")) is True:
            put("train.precision", name, (name, "enabled"))


def merge_imported(data: dict[str, Any], imported: Imported, set_keys: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``data`` (the job file) with the file's typed values and pass-through keys; a key both set differently is
    a ConfigError naming the key in the file and the job's key, unless ``--set`` gives it (``set_keys``)."""
    merged = {section: dict(values) if isinstance(values, dict) else values for section, values in data.items()}
    for typed, value in imported.typed.items():
        section, key = typed.split(".")
        table = _table(merged, section)
        if key in table and table[key] != value and typed not in set_keys:
            raise ConfigError(imported.origin[typed], f"= {shown_value(value)} contradicts {typed} = "
                              f"{shown_value(table[key])} in the job file",
                              f"remove one of them (or give the value with --set {typed}=...)")
        table[key] = value
    user = _table(merged, "deepspeed")
    for key, value in imported.passthrough.items():
        if key in user and user[key] != value:
            raise ConfigError(f"{imported.source}: {key}",
                              f"contradicts deepspeed.{key} in the job file", "keep it in one place")
        user[key] = value
    return merged


def _table(merged: dict[str, Any], section: str) -> dict[str, Any]:
    table = merged.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(section, f"expected a [{section}] table, got {shown_value(table, 40)}",
                          f"write it as a [{section}] section")
    return table


def imported_for(data: dict[str, Any], config_dir: Path) -> Imported | None:
    """The file ``[train] deepspeed_config`` of a job file's ``data`` names, read; None without one."""
    train = data.get("train")
    value = train.get("deepspeed_config") if isinstance(train, dict) else None
    if not isinstance(value, str) or not value:
        return None
    return import_deepspeed_config(config_dir / value, value)


def named_in_file(error: ConfigError, imported: Imported | None, values: dict[str, Any] | None = None) -> ConfigError:
    """A check's error on a typed key that came from the file, naming the key in the file (the typed key after).
    With ``values`` (the job's sections as tables), only when the job holds the file's value: a key ``--set``
    gave another value is the command line's, and named as it is."""
    if imported is not None and error.where.startswith("deepspeed."):  # a key the file passed through
        node: Any = imported.passthrough
        for part in error.where.removeprefix("deepspeed.").split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return ConfigError(f"{imported.source}: {error.where.removeprefix('deepspeed.')}", error.problem,
                               error.fix)
    if imported is None or error.where not in imported.origin:
        return error
    if values is not None:
        section, _, key = error.where.partition(".")
        table = values.get(section)
        if not isinstance(table, dict) or table.get(key) != imported.typed[error.where]:
            return error
    return ConfigError(f"{imported.origin[error.where]} (as {error.where})", error.problem, error.fix)
