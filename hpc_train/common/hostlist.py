"""Slurm host-list expressions (``node[001-004,010]-ib,gpu7``) in pure Python.

Why: every rank needs MASTER_ADDR, the first host of ``SLURM_JOB_NODELIST``. Calling
``scontrol show hostnames`` for it starts a process on every rank and needs the Slurm client
and a readable slurm.conf inside the container; parsing here costs microseconds.

Behaviour follows ``scontrol show hostnames`` / ``scontrol show hostlist`` (checked against
Slurm 22.05), with these deliberate differences:

* a suffix after the last bracket (``node[1-2]-ib``) is accepted; Slurm 22.05 rejects it;
* input Slurm tolerates by accident is rejected: empty list items (``n1,,n2``), whitespace,
  unbalanced brackets (``n1-2]``), open ranges (``n[1-]``), signs or ``_`` in numbers;
* the size limit is on the whole expression (``max_hosts``, default 1,000,000), where
  Slurm refuses any single range of more than 65,536 hosts;
* numbers keep their exact value up to 64 digits, where Slurm clamps them at 2**64-1.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator

__all__ = ["DEFAULT_MAX_HOSTS", "compress", "expand", "first_host"]

DEFAULT_MAX_HOSTS = 1_000_000
_MAX_DIGITS = 64  # longer digit runs are not numbers (and int() refuses > 4300 digits)

_SYNTAX = ("valid syntax is comma-separated host names, each with optional bracketed decimal ranges, "
           "e.g. 'node[001-004,010]-ib,gpu7' or 'r[1-2]n[01-16]'")
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_BRACKET_RE = re.compile(r"\[([^\]]*)\]")
_LAST_NUMBER = re.compile(r"(.*[^0-9]|)([0-9]+)([^0-9]*)", re.DOTALL)
_TRAILING_NUMBER = re.compile(r"(.*[^0-9]|)([0-9]+)()", re.DOTALL)
_BAD_NAME_CHAR = re.compile(r"[\[\],\s]")
_SYNTAX_CHAR = re.compile(r"[\[\],]")
_WHITESPACE = re.compile(r"\s")

# A bracket group is a tuple of (low, high, width) ranges; a pattern alternates literal text and groups.
_Range = tuple[int, int, int]
_Part = str | tuple[_Range, ...]


def _fail(expr: str, problem: str) -> ValueError:
    shown = expr if len(expr) <= 120 else f"{expr[:100]}...<{len(expr)} characters>"
    return ValueError(f"invalid Slurm host list {shown!r}: {problem}; {_SYNTAX}")


def _split_items(expr: str) -> list[str]:
    """Split at top-level commas, checking characters and bracket balance on the way."""
    if not expr:
        raise _fail(expr, "the expression is empty")
    if not expr.isprintable() or _WHITESPACE.search(expr):
        i, ch = next((i, ch) for i, ch in enumerate(expr) if ch.isspace() or not ch.isprintable())
        raise _fail(expr, f"character {ch!r} at position {i} (no whitespace or control characters)")
    items, start, open_at = [], 0, -1
    for m in _SYNTAX_CHAR.finditer(expr):
        i, ch = m.start(), m[0]
        if ch == "[":
            if open_at >= 0:
                raise _fail(expr, f"nested '[' at position {i} (brackets cannot nest)")
            open_at = i
        elif ch == "]":
            if open_at < 0:
                raise _fail(expr, f"']' at position {i} without a matching '['")
            open_at = -1
        elif open_at < 0:  # a comma outside brackets ends an item
            items.append(expr[start:i])
            start = i + 1
    if open_at >= 0:
        raise _fail(expr, f"'[' at position {open_at} is never closed")
    items.append(expr[start:])
    if "" in items:
        raise _fail(expr, "empty host name (leading, trailing or doubled comma)")
    return items


def _parse_group(expr: str, body: str) -> tuple[_Range, ...]:
    ranges = []
    where = f"in '[{body}]'" if len(body) <= 60 else f"in '[{body[:50]}...]'"
    for spec in body.split(","):
        if not spec:
            raise _fail(expr, f"empty range {where}")
        m = _RANGE_RE.fullmatch(spec)
        if m is None:
            raise _fail(expr, f"range {spec[:60]!r} {where} is not N or LOW-HIGH with decimal digits")
        if max(len(m[1]), len(m[2] or "")) > _MAX_DIGITS:
            raise _fail(expr, f"number in range {spec[:20] + '...'!r} has more than {_MAX_DIGITS} digits")
        low, high = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if low > high:
            raise _fail(expr, f"reversed range {spec!r} (low {low} > high {high})")
        ranges.append((low, high, len(m[1])))  # Slurm pads to the width of the low bound
    return tuple(ranges)


def _parse(expr: str, max_hosts: int) -> list[tuple[_Part, ...]]:
    """Parse and validate the whole expression; nothing is expanded."""
    if not isinstance(expr, str):
        raise TypeError(f"host list must be a str, not {type(expr).__name__}")
    patterns, total = [], 0
    for item in _split_items(expr):
        pieces = _BRACKET_RE.split(item)  # literal, group body, literal, ..., literal
        pattern: list[_Part] = []
        count = 1
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if piece:
                    pattern.append(piece)
                continue
            group = _parse_group(expr, piece)
            count *= sum(high - low + 1 for low, high, _ in group)
            pattern.append(group)
        total += count
        if total > max_hosts:
            raise _fail(expr, f"expands to more than max_hosts={max_hosts:,} hosts")
        patterns.append(tuple(pattern))
    return patterns


def _numbers(group: tuple[_Range, ...]) -> Iterator[str]:
    for low, high, width in group:
        for n in range(low, high + 1):
            yield str(n).zfill(width)


def expand(expr: str, *, max_hosts: int = DEFAULT_MAX_HOSTS) -> list[str]:
    """Return every host named by a Slurm host-list expression, in Slurm's order.

    Items keep their order, duplicates are kept, and with several bracket groups in one
    name the last group varies fastest (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
    Raises ``ValueError`` on bad syntax or when more than ``max_hosts`` hosts would result.
    """
    hosts: list[str] = []
    for pattern in _parse(expr, max_hosts):
        choices = [(part,) if isinstance(part, str) else list(_numbers(part)) for part in pattern]
        hosts.extend(map("".join, itertools.product(*choices)))
    return hosts


def first_host(expr: str, *, max_hosts: int = DEFAULT_MAX_HOSTS) -> str:
    """Return ``expand(expr)[0]`` without expanding the list (the whole expression is still validated)."""
    pattern = _parse(expr, max_hosts)[0]
    return "".join(part if isinstance(part, str) else str(part[0][0]).zfill(part[0][2]) for part in pattern)


def _check_name(host: object) -> str:
    if not isinstance(host, str):
        raise TypeError(f"host names must be str, not {type(host).__name__}: {host!r}")
    if not host or not host.isprintable() or _BAD_NAME_CHAR.search(host):
        raise ValueError(f"cannot compress host name {host!r}: names must be non-empty and free of "
                         "'[', ']', ',', whitespace and control characters")
    return host


def _render(prefix: str, suffix: str, runs: list[list]) -> str:
    """One bracket group; a run is [first digits, low, high, width]."""
    if len(runs) == 1 and runs[0][1] == runs[0][2]:
        return f"{prefix}{runs[0][0]}{suffix}"
    body = ",".join(first if low == high else f"{first}-{str(high).zfill(width)}" for first, low, high, width in runs)
    return f"{prefix}[{body}]{suffix}"


def compress(hosts: Iterable[str], *, suffixes: bool = True) -> str:
    """Return a host-list expression for ``hosts``, the inverse of :func:`expand`.

    Like ``scontrol show hostlist`` the order is kept: neighbours that differ only in their
    last run of digits share one bracket group, consecutive numbers of the same zero padding
    become ranges, and nothing is sorted or de-duplicated (``n3,n1,n2`` -> ``n[3,1-2]``,
    ``n1,gpu7,n2`` stays as is). So ``expand(compress(x)) == x`` for every non-empty ``x``;
    pass hosts de-duplicated in natural order (n2 before n10) for the shortest form. With ``suffixes=False``
    only trailing digits are grouped (``node1-ib`` stays alone), which Slurm 22.05 itself can read back and
    matches its output byte for byte. An empty input gives ``""``.
    """
    if isinstance(hosts, str):
        raise TypeError("compress() takes an iterable of host names, not one str (expand() parses expressions)")
    splitter = _LAST_NUMBER if suffixes else _TRAILING_NUMBER
    out: list[str] = []
    key: tuple[str, str] | None = None
    runs: list[list] = []
    for host in map(_check_name, hosts):
        m = splitter.fullmatch(host)
        if m is not None and len(m[2]) > _MAX_DIGITS:
            m = None  # written as a plain name
        if m is None or (m[1], m[3]) != key:
            if key is not None:
                out.append(_render(*key, runs))
            key, runs = None, []
            if m is None:
                out.append(host)
                continue
            key = (m[1], m[3])
        digits, n = m[2], int(m[2])
        last = runs[-1] if runs else None
        if last is not None and n == last[2] + 1 and str(n).zfill(last[3]) == digits:
            last[2] = n
        else:
            runs.append([digits, n, n, len(digits)])
    if key is not None:
        out.append(_render(*key, runs))
    return ",".join(out)
