"""Credentials in a job or site file, found by the one rule of :mod:`hpc_train.config.secrets` before any key is
interpreted, so that no later message, plan, script or log can hold one.

Where the job needs the real value (``[env]``, ``[params]``, ``job.args``, any typed key), a secret is refused:
a placeholder there would fail later inside the user's program. In DeepSpeed's sections (``[deepspeed]`` and an
imported ``ds_config.json``), it is written as ``"<redacted>"`` and left out of the config DeepSpeed gets, whose
loggers read the same credential from the environment (``WANDB_API_KEY``, ``COMET_API_KEY``), which
``job.forward_env`` passes from the submitting shell without writing it anywhere.
"""

from __future__ import annotations

import sys
from typing import Any

from hpc_train.config.secrets import REDACTED, redact, secret_reason, secret_value
from hpc_train.errors import ConfigError

__all__ = ["REDACTED_SECTIONS", "screen_job", "screen_site", "warn_redacted"]

REDACTED_SECTIONS = ("deepspeed",)
_FIXES = {
    "env": 'remove it and add "{name}" to job.forward_env, or read it from a 0600 file on the compute node',
    "params": 'remove it; pass it from your shell with job.forward_env = ["NAME"] and read os.environ in your '
              "program",
    "job": 'remove it; pass it from your shell with job.forward_env = ["NAME"] and read os.environ in your program',
}


def _key_shown(key: str) -> str:
    return REDACTED if secret_value(key) else key


def _refused(where: str, name: str, reason: str, section: str) -> ConfigError:
    fix = _FIXES.get(section, "remove it; a credential is never written into a plan").format(name=name)
    return ConfigError(where, f"looks like a secret ({reason}) and would be written into the plan, config.toml "
                       "and the job script", fix)


def _arg_pairs(args: list[Any]) -> list[tuple[str, Any]]:
    """``job.args`` as (the option that names it, the value): ``--api-key=V``, ``--api-key V``, a bare value."""
    pairs: list[tuple[str, Any]] = []
    for index, item in enumerate(args):
        previous = args[index - 1] if index else None
        if isinstance(item, str) and item.startswith("-") and "=" in item:
            option, _, value = item.partition("=")
            pairs.append((option.lstrip("-"), value))
        elif isinstance(previous, str) and previous.startswith("-") and "=" not in previous:
            pairs.append((previous.lstrip("-"), item))
        else:
            pairs.append(("", item))
    return pairs


def _walk(data: dict[str, Any], values: bool, section: str = "") -> None:
    """Refuse a secret value (when ``values``) or a key that has a secret's shape, anywhere in ``data``."""
    stack: list[tuple[str, str, Any]] = [(section, section, data)]
    while stack:
        where, name, value = stack.pop()
        top = section or where.split(".")[0].split("[")[0]
        if isinstance(value, dict):
            for key, item in value.items():
                key_text = str(key)
                if secret_value(key_text):
                    raise ConfigError(f"{where or '(top)'}: a key", "has the shape of a credential", "remove it")
                stack.append((f"{where}.{key_text}" if where else key_text, key_text, item))
        elif isinstance(value, list):
            pairs = _arg_pairs(value) if where == "job.args" else [(name, item) for item in value]
            stack.extend((f"{where}[{index}]", pair_name, item) for index, (pair_name, item) in enumerate(pairs))
        elif values:
            reason = secret_reason(name, value)
            if reason:
                shown = ".".join(_key_shown(part) for part in where.split("."))
                raise _refused(shown, name, reason, top)


def screen_job(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with the secrets of DeepSpeed's sections written as ``"<redacted>"`` (their keys returned, for
    :func:`warn_redacted`); a ConfigError for a secret anywhere else, naming the key and never the value."""
    screened = dict(data)
    found: list[str] = []
    for section, table in data.items():
        if section in REDACTED_SECTIONS and isinstance(table, dict):
            _walk(table, values=False, section=section)
            screened[section] = redact(table, "", section, found)
        else:
            _walk({section: table}, values=True)
    return screened, found


def screen_site(data: dict[str, Any]) -> None:
    """A site file holds no credential anywhere: its ``[env]`` is exported into every job's script."""
    _walk(data, values=True)


_READERS = {"wandb": "WANDB_API_KEY", "comet": "COMET_API_KEY"}  # what DeepSpeed's loggers read instead


def warn_redacted(keys: list[str], source: str = "") -> None:
    """One warning a key: its value is in no plan, and DeepSpeed does not get the placeholder."""
    for key in keys:
        where = f"{source}: {key}" if source else key
        reader = next((name for section, name in _READERS.items() if section in key.lower()), "")
        fix = f'job.forward_env = ["{reader}"] passes it from your shell' if reader else \
            "pass it from your shell by the variable its reader takes, listed in job.forward_env"
        print(f'warning: {where}: looks like a credential; written as "{REDACTED}" and not given to DeepSpeed. '
              f"Fix: {fix}", file=sys.stderr)
