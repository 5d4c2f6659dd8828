"""Per-value checks shared by job and site configs.

Every value that can reach an ``#SBATCH`` line or a shell word is checked here against the characters its
field allows. ``shlex.quote`` does not protect ``#SBATCH`` lines (a newline ends the directive and the rest
runs as shell), so control characters are refused everywhere and each field has an allow-list.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from hpc_train.common.hostlist import first_host
from hpc_train.common.terminal import UNSAFE_IN_LINE

__all__ = [
    "Check",
    "TableCheck",
    "as_slurm_name",
    "check_constraint",
    "check_env_name",
    "check_env_value",
    "check_gdr_level",
    "check_hca",
    "check_hostlist",
    "check_ifname",
    "check_image",
    "check_mem",
    "check_module",
    "check_nccl_name",
    "check_path",
    "check_signal",
    "check_slurm_name",
    "check_srun_arg",
    "check_time",
    "has_control_chars",
    "parse_time_seconds",
]

# A check returns None when the value is fine, else (problem, fix).
Check = Callable[[str], "tuple[str, str] | None"]
# A free table's check returns None, else (the key path below the table, problem, fix).
TableCheck = Callable[[dict], "tuple[str, str, str] | None"]

_CONTROL = UNSAFE_IN_LINE  # control characters, line separators, bidirectional overrides (hpc_train.common.terminal)
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_CONSTRAINT = re.compile(r"[A-Za-z0-9._+\-&|\[\]*:()]{1,256}")
_HOSTLIST = re.compile(r"[A-Za-z0-9._\-\[\],]{1,4096}")
_PATH = re.compile(r"[A-Za-z0-9._/+@,:=-]{1,4096}")
_MEM = re.compile(r"(0|[1-9][0-9]*[KMGT]?)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_MODULE = re.compile(r"[A-Za-z0-9._+/-]{1,256}")
_HCA = re.compile(r"[\^=]{0,2}[A-Za-z0-9._-]{1,64}(:[0-9]{1,3})?")
_IFNAME = re.compile(r"[\^=]{0,2}[A-Za-z0-9._-]{1,64}(,[A-Za-z0-9._-]{1,64})*")
_IMAGE = re.compile(r"[A-Za-z0-9._/+@,:=#-]{1,4096}")
_SRUN_ARG = re.compile(r"--[a-z][a-z-]{0,63}(=[A-Za-z0-9._,:/=+-]{1,256})?")
_TIME_FORMATS = (
    re.compile(r"(?P<m>[0-9]+)"),
    re.compile(r"(?P<m>[0-9]+):(?P<s>[0-9]+)"),
    re.compile(r"(?P<h>[0-9]+):(?P<m>[0-9]+):(?P<s>[0-9]+)"),
    re.compile(r"(?P<d>[0-9]+)-(?P<h>[0-9]+)"),
    re.compile(r"(?P<d>[0-9]+)-(?P<h>[0-9]+):(?P<m>[0-9]+)"),
    re.compile(r"(?P<d>[0-9]+)-(?P<h>[0-9]+):(?P<m>[0-9]+):(?P<s>[0-9]+)"),
)
# Signals a job may ask Slurm for. USR1 is NCCL's; KILL and STOP cannot be caught.
VALID_SIGNALS = ("USR2", "TERM", "INT", "HUP", "QUIT", "ALRM", "URG")


def has_control_chars(value: str) -> bool:
    """True when ``value`` holds a newline, carriage return, NUL or any other control character."""
    return bool(_CONTROL.search(value))


def _control(value: str) -> tuple[str, str] | None:
    if has_control_chars(value):
        return (f"{value!r} contains a control character (newline, tab, NUL ...)", "use a single line of plain text")
    return None


def _allow_only(pattern: re.Pattern[str], problem: str, fix: str, empty_ok: bool, doc: str) -> Check:
    """A check that accepts ``pattern`` (and '' when ``empty_ok``), refuses control characters first, and
    otherwise returns ``problem`` (formatted with ``value``) and ``fix``."""

    def check(value: str) -> tuple[str, str] | None:
        if not value and empty_ok:
            return None
        bad = _control(value)
        if bad or pattern.fullmatch(value):
            return bad
        return (problem.format(value=value), fix)

    check.__doc__ = doc
    return check


def as_slurm_name(text: str, fallback: str, limit: int = 60) -> str:
    """``text`` made a name ``check_slurm_name`` takes (a run's name from a script or a function's name):
    other characters become "-", a leading one that is not a letter or digit goes; ``fallback`` when none is left."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).lstrip("._+-")[:limit].rstrip("-")
    return name if name and _SLURM_NAME.fullmatch(name) else fallback


check_slurm_name = _allow_only(
    _SLURM_NAME, "{value!r} is not allowed",
    "use 1-128 characters from A-Z a-z 0-9 . _ + - starting with a letter or digit", True,
    "Job names, partitions, accounts, QoS: Slurm identifiers, never shell.")
check_constraint = _allow_only(
    _CONSTRAINT, "{value!r} is not a Slurm constraint", "use feature names joined by & | and [ ] ( ) only", True,
    "Slurm feature expressions such as ``a100&ib`` or ``[rack1|rack2]``.")
_check_hostlist_chars = _allow_only(
    _HOSTLIST, "{value!r} is not a Slurm host list", "write it like node[01-04],gpu7 (letters, digits, . _ - [ ] ,)",
    True, "")
# Slurm itself refuses a range of more than 65,536 hosts; no job names more.
MAX_HOSTS = 65536


def check_hostlist(value: str) -> tuple[str, str] | None:
    """Host-list expressions such as ``node[01-04,07],gpu3``, checked by the parser that expands them later."""
    bad = _check_hostlist_chars(value)
    if bad or not value:
        return bad
    if value.startswith("[") or ",[" in value:
        return (f"{value[:80]!r} is not a Slurm host list: a host name starts with a bracket",
                "give each host its name before the brackets, like node[01-04]")
    try:
        first_host(value, max_hosts=MAX_HOSTS)
    except ValueError as error:
        problem = str(error).split(": ", 1)[-1].split("; valid syntax")[0]
        return (f"{value[:80]!r} is not a Slurm host list: {problem}",
                f"write it like node[01-04],gpu7, naming at most {MAX_HOSTS:,} hosts")
    return None


check_mem = _allow_only(
    _MEM, "{value!r} is not a Slurm memory size", 'write a number with an optional K/M/G/T suffix, like "64G"', True,
    'Memory per node in Slurm syntax: ``0`` (all), ``64000`` (MB) or ``512G``.')
check_env_name = _allow_only(
    _ENV_NAME, "{value!r} is not a valid environment variable name",
    "use letters, digits and _ not starting with a digit", False,
    "Environment variable names: they are written as ``export NAME=...``.")
check_module = _allow_only(
    _MODULE, "{value!r} is not a module name", "use letters, digits and . _ + / - only", True,
    "Environment-module names such as ``cuda/12.4``; also host-name suffixes.")
check_hca = _allow_only(
    _HCA, "{value!r} is not an RDMA device", 'write it like "mlx5_0", "mlx5_0:1" or "=mlx5_0" (exact match)', False,
    "One NCCL_IB_HCA item: ``mlx5_0``, ``mlx5_0:1``, or ``=mlx5_0`` (exact) / ``^mlx5_1`` (exclude) first.")
check_ifname = _allow_only(
    _IFNAME, "{value!r} is not a network interface", 'write it like "ib0", "=eth0" or "^docker,lo"', True,
    "A socket interface for NCCL: ``ib0``, a prefix ``eth``, ``=eth0`` (exact) or ``^docker,lo`` (exclude).")
check_image = _allow_only(
    _IMAGE, "{value!r} is not a container image reference", "use a path or registry reference without spaces", True,
    "Container images: paths, ``docker://repo:tag`` or enroot's ``nvcr.io#nvidia/pytorch:24.11-py3``.")
check_srun_arg = _allow_only(
    _SRUN_ARG, "{value!r} is not a single srun flag", 'write one flag per item, like "--mpi=pmi2" or "--cpu-bind=none"',
    False, "Extra srun flags a site needs, each one ``--flag`` or ``--flag=value`` token.")
_check_path_chars = _allow_only(
    _PATH, "{value!r} has characters that cannot appear in an #SBATCH path",
    "use a path of letters, digits and . _ / + @ , : = - (no spaces, quotes, $ or ~)", False, "")


# What a Linux file system takes in one name (NAME_MAX): a longer one failed with ENAMETOOLONG at the first read.
MAX_NAME = 255


def check_path(value: str) -> tuple[str, str] | None:
    """Paths that end up in ``#SBATCH --output`` lines, where whitespace and quotes cannot be used."""
    if not value:
        return ("the path is empty", "give a directory path")
    longest = max(len(part.encode()) for part in value.split("/"))
    if longest > MAX_NAME:
        return (f"has a name of {longest:,} characters between slashes", f"keep each name under {MAX_NAME + 1}")
    return _check_path_chars(value)


def check_optional_path(value: str) -> tuple[str, str] | None:
    """A folder path that may be left empty (its default then applies)."""
    return _check_path_chars(value) if value else None


def check_env_value(value: str) -> tuple[str, str] | None:
    """Environment values are shell-quoted when written, but must still be one line."""
    return _control(value)


def check_nccl_name(value: str) -> tuple[str, str] | None:
    """[network.nccl] holds NCCL variables only; anything else belongs in [env]."""
    if value.startswith("NCCL_") and _ENV_NAME.fullmatch(value):
        return None
    return (f"{value!r} is not an NCCL variable", "put NCCL_* settings here and other variables in [env]")


GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")


def check_gdr_level(value: str) -> tuple[str, str] | None:
    """NCCL_NET_GDR_LEVEL by name: how far apart a NIC and a GPU may be for GPUDirect RDMA."""
    if value == "" or value in GDR_LEVELS:
        return None
    return (f"{value!r} is not a GPUDirect RDMA level", f"use one of {', '.join(GDR_LEVELS)}, or leave it empty")


def check_signal(value: str) -> tuple[str, str] | None:
    """Preemption signals: named, catchable, and not USR1 (NCCL and submitit's default kill use it)."""
    name = value.upper().removeprefix("SIG")
    if name in VALID_SIGNALS:
        return None
    if name == "USR1":
        return ("USR1 is used by NCCL and kills a default submitit job", 'use "USR2" (the default) or "TERM"')
    return (f"{value!r} is not a signal a job can catch", f"use one of {', '.join(VALID_SIGNALS)}")


def parse_time_seconds(value: str) -> int | None:
    """Seconds in a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``); None if invalid."""
    for pattern in _TIME_FORMATS:
        match = pattern.fullmatch(value)
        if not match:
            continue
        got = {k: int(v) for k, v in match.groupdict().items() if v is not None}
        d, h, m, s = (got.get(k, 0) for k in "dhms")
        if ("s" in got and s >= 60) or ("h" in got and m >= 60) or ("d" in got and h >= 24):
            return None
        return d * 86400 + h * 3600 + m * 60 + s
    return None


def check_time(value: str) -> tuple[str, str] | None:
    """Slurm time limits; a zero limit is refused because Slurm would treat it as 'no limit' on some sites."""
    bad = _control(value)
    if bad:
        return bad
    seconds = parse_time_seconds(value)
    if seconds is None:
        return (
            f"{value!r} is not a Slurm time limit",
            'write MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, like "04:00:00" or "2-00:00:00"',
        )
    if seconds < 60:
        return (f"{value!r} is under one minute", "give at least 1 minute, like \"00:10:00\"")
    return None
