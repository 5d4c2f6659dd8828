"""The checkpoint manifest: what a step folder must hold, so a resume can prove it is whole before loading it.

``manifest.json`` is the commit marker of a step folder (as torch DCP's ``.metadata`` and torchtitan's rule
"a step folder counts only with its metadata file"): it is written after every file is on disk, and lists each
file's relative path, size and sha256. A resume compares the folder against it, so a truncated, extended or
bit-flipped shard is found before ``torch.load`` sees it.

Parsing is strict (unknown keys, wrong types, paths that leave the folder are errors naming the field) because
the manifest decides which files a resume opens: a manifest that could name ``../../x`` or ``/etc/passwd``
would let whoever wrote it steer the loader. No torch import: ``ckpt ls/verify`` run on login nodes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DTYPES", "ENGINES", "FORMAT", "LAYOUT_AXES", "MANIFEST_NAME", "FileEntry", "Manifest",
           "check_relative_path", "engine_text", "sha256_file"]

FORMAT = 1
MANIFEST_NAME = "manifest.json"
LAYOUT_AXES = ("tensor", "pipeline", "data", "context")
DTYPES = ("bf16", "fp16", "fp32")
# What wrote the folder: the trainer's DeepSpeed engine, the trainer's FSDP2 engine, or a user's own program through
# ctx.checkpoint (its ranks/rank-N.pt, with any DeepSpeed engine or FSDP2 module it handed over inside).
ENGINES = ("deepspeed", "fsdp2", "program")
_CHUNK = 8 << 20  # 8 MiB: large enough for full disk bandwidth, small enough to keep memory flat
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PROGRAM_FILE = re.compile(r"^ranks/rank-[0-9]+\.pt$")


def sha256_file(path: Path, chunk: int = _CHUNK) -> tuple[int, str]:
    """Return ``(size, sha256 hex)`` of ``path``, read in chunks; the final component must not be a symlink."""
    digest = hashlib.sha256()
    size = 0
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(descriptor, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def check_relative_path(where: str, value: object) -> str:
    """Return ``value`` if it is a safe relative POSIX path inside the folder, else raise ValueError."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: must be a non-empty string, got {value!r}")
    if "\\" in value or "\x00" in value or value.startswith("/"):
        raise ValueError(f"{where}: {value!r} is not a relative POSIX path")
    parts = value.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{where}: {value!r} has an empty, '.' or '..' component; paths must stay in the folder")
    if value == MANIFEST_NAME:
        raise ValueError(f"{where}: the manifest cannot list itself")
    return value


def _int(where: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: must be >= {minimum}, got {value}")
    return value


def _str(where: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: must be a non-empty string, got {value!r}")
    return value


def _exact_keys(where: str, data: object, keys: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
    missing = [key for key in keys if key not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    return data


def _engine_of(entries: Sequence[FileEntry]) -> str:
    """What wrote a folder whose manifest has no ``engine`` key, told by its files: the FSDP2 trainer writes
    ``dcp/``, a program ``ranks/rank-N.pt`` on every rank, the DeepSpeed trainer neither (the trainers'
    ``ranks/ranks-FIRST-LAST.pt`` are a node's random states). A manifest names its engine only where the
    files would tell another, so versions from before the key read the rest."""
    if any(entry.path.startswith("dcp/") for entry in entries):
        return "fsdp2"  # the FSDP2 trainer wrote ranks/rank-N.pt too before its node files (and a program's DCP
    if any(_PROGRAM_FILE.match(entry.path) for entry in entries):  # module now says "engine" itself)
        return "program"
    return "deepspeed"


def engine_text(engine: str, zero_stage: int) -> str:
    """The engine as ``ckpt ls`` and export's messages name it: ``DeepSpeed ZeRO-2``, ``FSDP2``, ``program``."""
    return {"deepspeed": f"DeepSpeed ZeRO-{zero_stage}", "fsdp2": "FSDP2"}.get(engine, "your program")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the step folder, size in bytes, sha256 hex."""

    path: str
    size: int
    sha256: str

    def validate(self, where: str = "file") -> None:
        check_relative_path(f"{where}.path", self.path)
        _int(f"{where}.size", self.size, 0)
        if not isinstance(self.sha256, str) or not _SHA256.match(self.sha256):
            raise ValueError(f"{where}.sha256: must be 64 lowercase hex digits, got {self.sha256!r}")

    @classmethod
    def from_dict(cls, data: object, where: str) -> FileEntry:
        fields = _exact_keys(where, data, ("path", "size", "sha256"))
        entry = cls(path=fields["path"], size=fields["size"], sha256=fields["sha256"])
        entry.validate(where)
        return entry


@dataclass(frozen=True)
class Manifest:
    """What one checkpoint holds; every construction is validated (ValueError naming the field)."""

    step: int
    world_size: int
    layout: Mapping[str, int]
    zero_stage: int
    dtype: str
    config_hash: str
    created: float
    files: tuple[FileEntry, ...] = field(default=())
    engine: str = "deepspeed"

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "layout", dict(self.layout) if isinstance(self.layout, Mapping) else self.layout)
        self._validate()

    def _validate(self) -> None:
        _int("manifest.step", self.step, 0)
        world = _int("manifest.world_size", self.world_size, 1)
        layout = _exact_keys("manifest.layout", self.layout, LAYOUT_AXES)
        product = math.prod(_int(f"manifest.layout.{axis}", layout[axis], 1) for axis in LAYOUT_AXES)
        if product != world:
            raise ValueError(f"manifest.layout: tensor x pipeline x data x context = {product}, "
                             f"but world_size is {world}")
        if _int("manifest.zero_stage", self.zero_stage, 0) > 3:
            raise ValueError(f"manifest.zero_stage: must be 0-3, got {self.zero_stage}")
        if self.engine not in ENGINES:
            raise ValueError(f"manifest.engine: must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"manifest.dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _str("manifest.config_hash", self.config_hash)
        created = self.created
        if isinstance(created, bool) or not isinstance(created, int | float) or not math.isfinite(created) \
                or created < 0:
            raise ValueError(f"manifest.created: must be a non-negative finite time, got {created!r}")
        seen: set[str] = set()
        for index, entry in enumerate(self.files):
            where = f"manifest.files[{index}]"
            if not isinstance(entry, FileEntry):
                raise ValueError(f"{where}: must be a FileEntry, got {type(entry).__name__}")
            entry.validate(where)
            if entry.path in seen:
                raise ValueError(f"{where}.path: {entry.path!r} is listed twice")
            seen.add(entry.path)

    def to_dict(self) -> dict[str, Any]:
        data = {"format": FORMAT, "step": self.step, "world_size": self.world_size, "layout": dict(self.layout),
                "engine": self.engine, "zero_stage": self.zero_stage, "dtype": self.dtype,
                "config_hash": self.config_hash, "created": self.created,
                "files": [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.files]}
        if self.engine == _engine_of(self.files):  # its files say it: a version before the key still reads it
            del data["engine"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        keys = ("format", "step", "world_size", "layout", "zero_stage", "dtype", "config_hash", "created", "files")
        if isinstance(data, Mapping) and "engine" in data:  # written since the engine was recorded
            keys = (*keys, "engine")
        fields = _exact_keys("manifest", data, keys)
        if fields["format"] != FORMAT or isinstance(fields["format"], bool):
            raise ValueError(f"manifest.format: this version reads format {FORMAT}, got {fields['format']!r}")
        files = fields["files"]
        if not isinstance(files, list):
            raise ValueError(f"manifest.files: must be a list, got {type(files).__name__}")
        entries = tuple(FileEntry.from_dict(item, f"manifest.files[{i}]") for i, item in enumerate(files))
        engine = fields["engine"] if "engine" in fields else _engine_of(entries)
        return cls(step=fields["step"], world_size=fields["world_size"], layout=fields["layout"],
                   zero_stage=fields["zero_stage"], dtype=fields["dtype"], config_hash=fields["config_hash"],
                   created=fields["created"], files=entries, engine=engine)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise ValueError(f"manifest: not valid JSON ({error})") from None
        except RecursionError:
            raise ValueError("manifest: nests too deep to be a manifest") from None
        return cls.from_dict(data)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)
