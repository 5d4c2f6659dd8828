"""The one rule for credentials: which keys name one and which values look like one, for every value that can
reach a plan, ``--json``, a rendered script, a log or a terminal.

Why one rule: the job's ``[env]``, its ``[params]``, ``job.args``, the ``[deepspeed]`` table and an imported
``ds_config.json`` all end up in ``plan.json`` and ``config.toml`` (on a shared file system) and on the screen.
Each surface once had its own idea of a secret, or none (a W&B or Comet key in ``ds_config.json`` was echoed by
``submit --dry-run --json``). What happens to a secret found depends on where it is (see
:mod:`hpc_train.config.screen`): refused where the job would need the real value, replaced by
:data:`REDACTED` in DeepSpeed's sections, whose loggers read the same key from the environment
(``job.forward_env``). The rule errs towards names and shapes that real credentials have and normal values
(paths, model names, tokenizer settings such as ``pad_token``) do not.
"""

from __future__ import annotations

import base64
import itertools
import math
import re
from collections import Counter
from typing import Any

__all__ = ["REDACTED", "redact", "secret_name", "secret_reason", "secret_value", "shown_value"]

REDACTED = "<redacted>"

# A word anywhere in the key: the key holds a credential whatever else it says (client_secret, db_password).
_ANYWHERE = frozenset({"secret", "secrets", "password", "passwords", "passwd", "passphrase", "credential",
                       "credentials", "apikey", "apikeys", "cookie", "cookies", "privatekey", "accesskey",
                       "secretkey", "authtoken", "accesstoken", "bearer"})
# The last word of the key, unless the word before it says it is something else (a tokenizer's pad_token).
_LAST = frozenset({"token", "key", "pat", "auth", "pwd"})
_NOT_SECRET_TOKENS = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "special", "start", "end", "max",
                                "min", "num", "first", "last", "sos", "image", "audio", "video", "vision", "default",
                                "decoder", "sentinel", "per", "new", "next", "prev", "stop", "n", "use", "no",
                                "eod", "eot", "boi", "eoi", "boa", "eoa", "padding", "think", "tool", "system",
                                "user", "assistant", "separator", "placeholder", "ignore", "extra"})
# A key that names where a credential is (a file, a path, a folder, the variable that holds it), not the value.
_WHERE = frozenset({"file", "path", "dir", "folder", "env", "var", "variable", "name", "names", "len", "length",
                    "count", "id", "ids", "type", "kind", "enabled", "disable", "disabled", "required"})
_PAT_KINDS = frozenset({"gh", "github", "gitlab", "git", "personal", "access", "azure", "ado", "bitbucket"})
# "key" alone names too many ordinary things (sort_key, dict_key); these say it is a credential.
_SECRET_KEY_KINDS = frozenset({"api", "access", "secret", "private", "auth", "signing", "encryption", "ssh",
                               "license", "licence", "client", "session", "master", "account", "service", "app",
                               "deploy", "wandb", "comet", "openai", "hf", "aws", "gcp", "azure",
                               "storage", "sas", "subscription", "consumer", "write", "read", "admin", "user"})
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+")

# Prefixes no ordinary value starts with: GitHub, GitLab, Slack, PyPI, Google, AWS.
_DISTINCT = re.compile(r"(?<![A-Za-z0-9])(gh[pousr]_|github_pat_|glpat-|xox[abposre]-|pypi-|AIza|ya29\.|"
                       r"sk_live_|rk_live_|shpat_|wandb_v1_)[A-Za-z0-9_\-]{8,}|(?<![A-Za-z0-9])(AKIA|ASIA)[A-Z0-9]{12,}")
# Prefixes that ordinary names share (hf_transfer, npm_config, wandb_project): a token only when what follows
# is not a name of short lowercase words.
_SHARED = re.compile(r"(?<![A-Za-z0-9])(sk-|npm_|dop_v1_)([A-Za-z0-9_.\-]{8,})")
# A Hugging Face token: hf_ and 16 or more letters and digits, nothing else (hf_Datasets_c4 is a name).
_HF_TOKEN = re.compile(r"(?<![A-Za-z0-9/])hf_[A-Za-z0-9]{16,}(?![A-Za-z0-9_])")
_NAME_LIKE = re.compile(r"[a-z][a-z0-9]{0,11}([_.\-][a-z0-9]{1,12})*")
_SHAPES = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.eyJ|-----BEGIN [A-Z ]*PRIVATE KEY|://[^/\s:@]+:[^/\s@]+@")
_RANDOM_RUN = re.compile(r"[A-Za-z0-9]{24,}")


def _words(name: str) -> list[str]:
    return [word for word in _WORD_SPLIT.split(_CAMEL.sub(r"\1_\2", name).lower()) if word]


def secret_name(name: str) -> bool:
    """True when the key ``name`` names a credential (api_key, apiKey, HF_TOKEN, db_password, GH_PAT)."""
    words = _words(name)
    if not words:
        return False
    last, before = words[-1], words[-2] if len(words) > 1 else ""
    if last == "id":
        return before == "session"
    if last in _WHERE:  # password_file, hf_token_path, token_env: where the secret is, never the secret
        return False
    if any(word in _ANYWHERE for word in words):
        return True
    if last not in _LAST:
        return False
    if last == "key":
        return before in _SECRET_KEY_KINDS
    if last == "pat":  # a personal access token (GH_PAT), not a pattern (data_pat)
        return before in _PAT_KINDS
    return before not in _NOT_SECRET_TOKENS


def _entropy(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _random_looking(run: str) -> bool:
    """A long run of mixed case and digits with the entropy of a random key (hex digests, words and base64 of
    text, such as a config passed as ``--config-b64 eyJ...``, excluded)."""
    if not (any(c.islower() for c in run) and any(c.isupper() for c in run)):
        return False
    if _base64_of_text(run):
        return False
    digits = sum(c.isdigit() for c in run)
    switches = sum(a.isdigit() != b.isdigit() for a, b in itertools.pairwise(run))
    return digits >= 2 and switches >= 4 and _entropy(run) >= 3.5


def _base64_of_text(run: str) -> bool:
    """Whether ``run`` is base64 of printable text (a JSON or YAML config encoded for the command line)."""
    try:
        decoded = base64.b64decode(run + "=" * (-len(run) % 4), validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return False
    return decoded.isprintable() and any(c in decoded for c in '{":= ')


def secret_value(value: str) -> str | None:
    """Why ``value`` has the shape of a credential; None when it does not."""
    if _DISTINCT.search(value) or _HF_TOKEN.search(value) or \
            any(not _NAME_LIKE.fullmatch(m.group(2)) for m in _SHARED.finditer(value)):
        return "a known token prefix"
    if _SHAPES.search(value):
        return "a web token, a private key or a password in a URL"
    if any(_random_looking(run) for run in _RANDOM_RUN.findall(value)):
        return "a long random string"
    return None


def secret_reason(name: str, value: Any) -> str | None:
    """Why ``name = value`` is a credential (by the key's name, or by the value's shape); None when it is not.
    Only a value that could hold one counts: true, false, an empty string or nothing is no secret."""
    if isinstance(value, bool | int | float) or value is None or value in ("", REDACTED) or value == [] or \
            value == {}:
        return None  # a number is no credential (eod_token = 50256)
    if secret_name(name):
        return f'its name "{name}" is one that holds credentials'
    if isinstance(value, str):
        shape = secret_value(value)
        if shape:
            return f"its value has the shape of a credential ({shape})"
    return None


def redact(value: Any, name: str = "", where: str = "", found: list[str] | None = None) -> Any:
    """A copy of ``value`` with every secret (by key or by shape, at any depth) replaced by :data:`REDACTED`;
    the dotted keys replaced are appended to ``found``. Iterative over depth only as deep as the data, which the
    callers bound (:data:`hpc_train.config.portable.MAX_DEPTH`)."""
    if secret_reason(name, value) and not isinstance(value, dict | list):
        if found is not None:
            found.append(where or name)
        return REDACTED
    if isinstance(value, dict):
        if secret_name(name) and value:
            if found is not None:
                found.append(where or name)
            return REDACTED
        return {key: redact(item, str(key), f"{where}.{key}" if where else str(key), found)
                for key, item in value.items()}
    if isinstance(value, list):
        if secret_name(name) and value:
            if found is not None:
                found.append(where or name)
            return REDACTED
        return [redact(item, name, f"{where}[{index}]", found) for index, item in enumerate(value)]
    return value


def shown_value(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut at ``limit``, or :data:`REDACTED` when it looks like a credential."""
    if isinstance(value, str) and secret_value(value):
        return REDACTED
    return repr(value)[:limit]
