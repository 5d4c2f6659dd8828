"""What DeepSpeed itself would refuse in a ``ds_config.json``, refused at ``validate`` with the file and key named.

Why here: a config DeepSpeed rejects (fp16 and bf16 both on, ``betas`` of three numbers) used to pass the login
node and fail minutes later on every rank, after the queue; a value only DeepSpeed's arithmetic meets
(``initial_scale_power = 5000``: ``2 ** 5000`` as a float) failed there with OverflowError. The typed keys a
file sets are checked again by their own ranges (:class:`hpc_train.config.fields.Range`); these are the rules
between keys, and the shapes of the values hpc_train reads before the typed keys exist. Pure Python.
"""

from __future__ import annotations

import math
from typing import Any

from hpc_train.errors import ConfigError

__all__ = ["check_semantics"]

_OFFLOAD_DEVICES = ("cpu", "none")
# (section, key) -> (lowest, highest, whether the lowest is allowed, integers only)
_NUMBERS: dict[tuple[str, ...], tuple[float, float, bool, bool]] = {
    ("optimizer", "params", "lr"): (0, 100, True, False),
    ("optimizer", "params", "eps"): (0, 1, False, False),  # train.eps must be positive too
    ("optimizer", "params", "weight_decay"): (0, 100, True, False),
    ("scheduler", "params", "warmup_min_lr"): (0, 100, True, False),
    ("scheduler", "params", "warmup_max_lr"): (0, 100, True, False),
    ("scheduler", "params", "warmup_num_steps"): (0, 10**12, True, True),
    ("scheduler", "params", "total_num_steps"): (1, 10**12, True, True),
    ("fp16", "loss_scale"): (0, 2.0**64, True, False),
    ("fp16", "initial_scale_power"): (0, 64, True, True),
    ("fp16", "loss_scale_window"): (1, 10**9, True, True),
    ("fp16", "hysteresis"): (1, 10**9, True, True),
    ("fp16", "min_loss_scale"): (0, 2.0**64, True, False),
}


def _get(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(data: dict[str, Any], path: tuple[str, ...], shown: str, sep: str) -> None:
    value = _get(data, path)
    if value is None or value == "auto":
        return
    low, high, low_ok, integer = _NUMBERS[path]
    where = f"{shown}{sep}{'.'.join(path)}"
    kind = "an integer" if integer else "a number"
    if not _is_number(value) or (integer and not isinstance(value, int)):
        raise ConfigError(where, f"is {str(value)[:40]!r}, not {kind}", f"write {kind} (or \"auto\")")
    if value < low or (value == low and not low_ok) or value > high:
        edge = f"{'>=' if low_ok else '>'} {low}"
        raise ConfigError(where, f"{str(value)[:24]} is outside what DeepSpeed takes ({edge}, at most {high:g})",
                          f"give {kind} {edge}")


def _check_precision(data: dict[str, Any], shown: str, sep: str) -> dict[str, Any]:
    """One number format: DeepSpeed asserts that fp16, bf16 (old name bfloat16) and amp are not on together."""
    if "bfloat16" in data:  # with both, DeepSpeed reads bf16 and ignores its old name
        data = {("bf16" if key == "bfloat16" else key): value for key, value in data.items()
                if not (key == "bfloat16" and "bf16" in data)}
    enabled = []
    for name in ("fp16", "bf16", "amp"):
        section = data.get(name)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{shown}{sep}{name}", f"is {str(section)[:40]!r}, not a section",
                              f'write {{"{name}": {{"enabled": true}}}}')
        flag = section.get("enabled", False)
        if flag not in (True, False, "auto"):
            raise ConfigError(f"{shown}{sep}{name}.enabled", f"is {str(flag)[:40]!r}, not true or false",
                              'write true, false or "auto"')
        if flag is True:
            enabled.append(name)
    if len(enabled) > 1:
        keys = " and ".join(f"{name}.enabled" for name in enabled)
        raise ConfigError(f"{shown}{sep}{keys}", "are both true; DeepSpeed refuses more than one number format",
                          "enable one of them (neither trains in fp32)")
    return data


def _check_betas(data: dict[str, Any], shown: str, sep: str) -> None:
    betas = _get(data, ("optimizer", "params", "betas"))
    if betas is None or betas == "auto":
        return
    good = isinstance(betas, list) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)
    if not good:
        raise ConfigError(f"{shown}{sep}optimizer.params.betas", f"is {str(betas)[:60]}, not two numbers in [0, 1)",
                          "write two numbers like [0.9, 0.95]: Adam's beta1 and beta2")


def _check_offload(data: dict[str, Any], shown: str, sep: str) -> None:
    for name in ("offload_optimizer", "offload_param"):
        device = _get(data, ("zero_optimization", name, "device"))
        if device is not None and device not in _OFFLOAD_DEVICES:
            raise ConfigError(f"{shown}{sep}zero_optimization.{name}.device", f"is {str(device)[:40]!r}; hpc_train "
                              "offloads to the CPU only (an NVMe offload would be silently dropped)",
                              'use "cpu" or "none"')


def check_semantics(data: dict[str, Any], shown: str, sep: str = ": ") -> dict[str, Any]:
    """``data`` (the file's object, with ``bfloat16`` read as ``bf16``) when DeepSpeed would take it; else a
    ConfigError naming ``shown`` (the file, or ``deepspeed`` with ``sep = "."`` for the job's table) and the
    key."""
    for section in ("optimizer", "scheduler", "zero_optimization"):
        if section in data and not isinstance(data[section], dict):
            raise ConfigError(f"{shown}{sep}{section}", f"is {str(data[section])[:40]!r}, not a section",
                              f'write {{"{section}": {{...}}}}')
    data = _check_precision(data, shown, sep)
    _check_betas(data, shown, sep)
    _check_offload(data, shown, sep)
    for path in _NUMBERS:
        _check_number(data, path, shown, sep)
    return data
