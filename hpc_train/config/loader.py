"""TOML to typed dataclasses, with unknown keys refused ("did you mean") and every value type-checked.

One generic walker serves job and site files, so both speak the same error language:
``job.nodes: expected an integer, got "two". Fix: ...``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from hpc_train.config.checks import check_env_value
from hpc_train.config.portable import check_portable
from hpc_train.errors import ConfigError, did_you_mean

__all__ = ["MAX_CONFIG_BYTES", "build", "checked_portable", "describe_type", "field_types", "load_toml", "rebuild"]

T = TypeVar("T")

# Keys that do not exist but that people will try, with what to do instead.
_KNOWN_MISTAKES = {
    "parallel.data": "data parallel size is derived: world / (tensor x pipeline); set job.nodes or "
    "job.tasks_per_node instead",
}


MAX_CONFIG_BYTES = 1 << 20


def _read_config_text(path: Path, what: str) -> str:
    """The file's text, read without blocking: a FIFO, a device or a huge file is refused before any read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(str(path), f"{what} file not found", "check the path") from None
    except OSError as error:
        raise ConfigError(str(path), f"cannot open the {what} file ({error.strerror or error})",
                          "give a readable TOML file") from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise ConfigError(str(path), f"the {what} file is {kind}", "give a regular TOML file")
    with os.fdopen(descriptor, "rb") as handle:
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(str(path), f"the {what} file is {info.st_size:,} bytes, over the "
                              f"{MAX_CONFIG_BYTES:,}-byte limit", "keep data out of the config; name a file instead")
        raw = handle.read(MAX_CONFIG_BYTES + 1)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(str(path), f"the {what} file is not UTF-8 text", "save it as UTF-8") from None


def checked_portable(data: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``data`` when it is portable (:func:`check_portable`), else a ConfigError naming the key."""
    bad = check_portable(data)
    if bad:
        key = f"{where}: {bad[0]}" if where else bad[0]
        raise ConfigError(key, bad[1], bad[2])
    return data


def load_toml(path: Path, what: str) -> dict[str, Any]:
    """Read a TOML file; a missing, unreadable or non-regular file, a syntax error or content that plan.json and
    config.toml cannot carry is a ConfigError naming the file."""
    text = _read_config_text(path, what)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(str(path), f"not valid TOML ({error})", "fix the syntax at that line") from None
    except RecursionError:
        raise ConfigError(str(path), "nests too deep to read", "flatten the arrays and tables") from None
    return checked_portable(data, str(path))


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a config dataclass (annotations are strings under PEP 563)."""
    return typing.get_type_hints(cls)


def describe_type(kind: Any) -> str:
    """A human name for a field type, used in messages and docs."""
    origin = get_origin(kind)
    if origin is Literal:
        return "one of " + ", ".join(f'"{choice}"' for choice in get_args(kind))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(describe_type(arg) for arg in get_args(kind) if arg is not type(None))
    if origin is list:
        item = get_args(kind)[0]
        return "a list of " + {int: "integers", str: "strings"}.get(item, describe_type(item))
    if origin is dict:
        return "a table" if get_args(kind)[1] is Any else "a table of strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind, str(kind))


def _convert(value: Any, kind: Any, where: str) -> Any:
    """Check ``value`` against ``kind`` and return it in that type; raise ConfigError naming ``where``."""
    origin = get_origin(kind)
    wrong = ConfigError(where, f"expected {describe_type(kind)}, got {value!r}", f"write {describe_type(kind)}")
    if origin in (types.UnionType, typing.Union):
        return _convert_union(value, kind, where, wrong)
    if origin is Literal:
        choices = get_args(kind)
        if value not in choices:
            hint = did_you_mean(str(value), choices) if isinstance(value, str) else ""
            raise ConfigError(where, f"\"{value}\" is not valid" + (f", {hint}" if hint else ""),
                              "use " + describe_type(kind))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise wrong
        return [_convert(item, get_args(kind)[0], f"{where}[{index}]") for index, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong
        if get_args(kind)[1] is Any:
            return value  # a free table passed on as it is (e.g. [deepspeed])
        converted = {}
        for key, item in value.items():
            if isinstance(item, bool):
                item = "1" if item else "0"
            elif isinstance(item, int | float):
                item = str(item)
            converted[key] = _convert(item, str, f"{where}.{key}")
        return converted
    if kind is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong
        if not math.isfinite(value):
            raise ConfigError(where, f"{value!r} is not a finite number", "write a number like 3e-4")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise wrong
        return value
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(where, f"expected a [{where}] table, got {value!r}", f"write it as a [{where}] section")
        return build(kind, value, where)
    raise TypeError(f"unsupported config type {kind!r} at {where}")  # a bug in a schema, not user input


def _convert_union(value: Any, kind: Any, where: str, wrong: ConfigError) -> Any:
    """An optional value (``int | None``), or one of several types (a number or "auto"): the first it fits."""
    inners = [arg for arg in get_args(kind) if arg is not type(None)]
    if len(inners) == 1:
        return _convert(value, inners[0], where)
    for inner in inners:
        try:
            return _convert(value, inner, where)
        except ConfigError:
            continue
    raise wrong


def _check_range(field: dataclasses.Field[Any], value: Any, where: str) -> None:
    """A number (or each number of a list) inside the field's declared :class:`~hpc_train.config.fields.Range`."""
    bounds = field.metadata.get("range")
    if bounds is None:
        return
    for index, item in enumerate(value if isinstance(value, list) else [value]):
        if isinstance(item, bool) or not isinstance(item, int | float):
            continue
        bad = bounds.problem(item)
        if bad:
            raise ConfigError(f"{where}[{index}]" if isinstance(value, list) else where, *bad)


def _run_check(field: dataclasses.Field[Any], value: Any, where: str) -> None:
    _check_range(field, value, where)
    table_check = field.metadata.get("table_check")
    if table_check is not None:
        bad_table = table_check(value)
        if bad_table:
            raise ConfigError(where + bad_table[0], bad_table[1], bad_table[2])
        return
    check = field.metadata.get("check")
    if isinstance(value, dict) and check is None:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            for checker, text in ((check, key), (check_env_value, item)):
                bad = checker(text) if checker else None
                if bad:
                    raise ConfigError(f"{where}.{key}", *bad)
        return
    items = value if isinstance(value, list) else [value]
    for index, item in enumerate(items):
        if check is not None and isinstance(item, str):
            bad = check(item)
            if bad:
                raise ConfigError(f"{where}[{index}]" if isinstance(value, list) else where, *bad)


def build(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a TOML table, refusing unknown keys and wrong types."""
    fields = {field.name: field for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = field_types(cls)
    values: dict[str, Any] = {}
    for key, raw in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            if where in _KNOWN_MISTAKES:
                raise ConfigError(where, "is not a setting", _KNOWN_MISTAKES[where])
            hint = did_you_mean(key, fields)
            valid = ", ".join(sorted(fields))
            kind = "section" if not prefix else "key"
            raise ConfigError(where, f"unknown {kind}" + (f", {hint}" if hint else ""), f"valid {kind}s here: {valid}")
        value = _convert(raw, hints[key], where)
        _run_check(fields[key], value, where)
        values[key] = value
    return cls(**values)


def rebuild(cls: type[T], data: dict[str, Any]) -> T:
    """Dataclass ``cls`` again from its ``dataclasses.asdict`` form (plan.json): nested sections become their
    dataclasses, every other value is taken as it is. For data this package wrote after :func:`build` checked
    it; user input goes through :func:`build`."""
    hints = field_types(cls)
    return cls(**{key: rebuild(hints[key], value) if dataclasses.is_dataclass(hints[key]) else value
                  for key, value in data.items()})
