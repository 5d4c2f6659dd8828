"""The control plane's wire format: one JSON object per line, each line bounded, nothing else on the socket.

Why lines of JSON: the agents never import torch (so no TCPStore client), every message is small and rare
(a hello, a ready, a restart notice), and a line that is not JSON or too long ends that connection, so a stray
or hostile client can cost the coordinator one socket, never a parse of megabytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["MAX_KEY", "MAX_LINE", "LineBuffer", "WireError", "decode", "encode"]

MAX_LINE = 64 * 1024  # bytes in one message: a restart notice is a few hundred
MAX_KEY = 256  # characters in a key


class WireError(ValueError):
    """A message that is not one bounded JSON object: the connection that sent it is closed."""


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{value} is not a number JSON holds")
    return value


def encode(message: dict[str, Any]) -> bytes:
    line = json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise WireError(f"a control message of {len(line)} bytes (at most {MAX_LINE})")
    return line


def decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line, parse_constant=lambda name: _finite(float(name)))
    except (ValueError, RecursionError) as error:
        raise WireError(f"not a JSON line: {error}") from None
    if not isinstance(message, dict):
        raise WireError("a control message is a JSON object")
    key = message.get("key")
    if key is not None and (not isinstance(key, str) or len(key) > MAX_KEY or "\n" in key):
        raise WireError(f"a key is a string of at most {MAX_KEY} characters")
    return message


class LineBuffer:
    """Bytes from a socket in, whole lines out; more than :data:`MAX_LINE` without a newline is an error."""

    def __init__(self) -> None:
        self._data = bytearray()

    def __len__(self) -> int:
        return len(self._data)

    def feed(self, chunk: bytes) -> list[bytes]:
        self._data += chunk
        lines = []
        while (end := self._data.find(b"\n")) >= 0:
            lines.append(bytes(self._data[:end]))
            del self._data[: end + 1]
        if len(self._data) > MAX_LINE:
            raise WireError(f"a control message over {MAX_LINE} bytes")
        return lines
