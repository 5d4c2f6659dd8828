"""``--set section.key=value`` overrides, typed like the TOML file."""

from __future__ import annotations

import dataclasses
import tomllib
from typing import Any, get_args, get_origin

from hpc_train.config.checks import has_control_chars
from hpc_train.config.loader import field_types
from hpc_train.config.secrets import REDACTED, secret_reason
from hpc_train.errors import ConfigError, did_you_mean

__all__ = ["apply_overrides", "parse_override"]


def _is_string_field(kind: Any) -> bool:
    """str and Literal-of-str fields take the raw text, so ``job.time=01:00:00`` stays a string."""
    if kind is str:
        return True
    return get_origin(kind) is not None and all(isinstance(arg, str) for arg in get_args(kind)) and bool(get_args(kind))


def _shown(text: str) -> str:
    """The override as a message may say it: a credential's value never (:mod:`hpc_train.config.secrets`)."""
    dotted, sep, raw = text.partition("=")
    key = dotted.strip().rpartition(".")[2]
    return f"{dotted}={REDACTED}" if sep and secret_reason(key, raw) else text


def _field_type(root: type, section: str, key: str, text: str) -> Any:
    """The declared type of ``section.key`` in ``root``; ConfigError with a suggestion when it does not exist."""
    sections = field_types(root)
    if section not in sections:
        hint = did_you_mean(section, sections)
        raise ConfigError(f"--set {_shown(text)}", f'unknown section "{section}"' + (f", {hint}" if hint else ""),
                          f"sections: {', '.join(sections)}")
    section_type = sections[section]
    if not dataclasses.is_dataclass(section_type):
        # A free table: [env] holds strings; [params] and [deepspeed] any TOML value, typed like the file
        # (text that is not a TOML value, such as --set params.name=abc, stays a string).
        return Any if get_args(section_type)[1] is Any else str
    keys = field_types(section_type)
    if key not in keys:
        hint = did_you_mean(f"{section}.{key}", [f"{section}.{name}" for name in keys])
        raise ConfigError(f"--set {_shown(text)}", f'unknown key "{section}.{key}"' + (f", {hint}" if hint else ""),
                          f"keys of [{section}]: {', '.join(keys)}")
    return keys[key]


def parse_override(text: str, root: type) -> tuple[str, str, Any]:
    """Split ``section.key=value`` and type the value from the schema of ``root``."""
    if has_control_chars(text):
        raise ConfigError(f"--set {_shown(text)!r}", "contains a control character (a newline would end the "
                          "value early)", "give one line of plain text")
    dotted, sep, raw = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not section or not key or "." in key:
        raise ConfigError(f"--set {_shown(text)}", "expected SECTION.KEY=VALUE", 'write it like --set train.lr=1e-3')
    kind = _field_type(root, section, key, text)
    if _is_string_field(kind):
        value: Any = raw
    else:
        try:
            value = tomllib.loads(f"value = {raw}")["value"]
        except (tomllib.TOMLDecodeError, RecursionError):
            value = raw  # a free table keeps it as text; elsewhere the loader reports the key's expected type
    return section, key, value


def apply_overrides(data: dict[str, Any], overrides: list[str], root: type) -> dict[str, Any]:
    """Return a copy of the TOML data with each override applied in order."""
    merged = {name: dict(table) if isinstance(table, dict) else table for name, table in data.items()}
    for text in overrides:
        section, key, value = parse_override(text, root)
        table = merged.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a [{section}] table", f"write it as a [{section}] section")
        table[key] = value
    return merged
