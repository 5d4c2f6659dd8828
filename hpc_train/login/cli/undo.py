"""Taking back what a submission wrote when sbatch refuses it: a refused submission leaves nothing behind.

The run folders (and submitit's pickles) must exist before sbatch runs, since a job may start at once and read
them. So they are written first and, if sbatch says no, removed again: a folder this submission created goes
whole; in a folder that was already there (a resumed run) what is new goes and what was rewritten (the plan,
the config, earlier results) gets its old bytes back. Nothing is followed through a link.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_train.run.paths import LOGS_DIR, SUBMITIT_DIR

__all__ = ["Undo"]

_WATCHED = ("", LOGS_DIR, SUBMITIT_DIR)  # the levels a submission writes into; checkpoints/ is never touched
_KEEP_BYTES = 1 << 20


def _entries(folder: Path) -> dict[str, bytes | None]:
    """Relative names in the watched levels of ``folder``, with the bytes of its small regular files."""
    found: dict[str, bytes | None] = {}
    for level in _WATCHED:
        try:
            names = os.listdir(folder / level) if level else os.listdir(folder)
        except OSError:
            continue
        for name in names:
            relative = f"{level}/{name}" if level else name
            info = os.lstat(folder / relative)
            small = stat.S_ISREG(info.st_mode) and info.st_size <= _KEEP_BYTES
            found[relative] = (folder / relative).read_bytes() if small else None
    return found


@dataclass
class Undo:
    """The state of some folders before a submission, and how to return to it."""

    created: list[Path] = field(default_factory=list)
    before: dict[Path, dict[str, bytes | None]] = field(default_factory=dict)
    new_roots: list[Path] = field(default_factory=list)

    @classmethod
    def record(cls, folders: Sequence[Path], roots: Sequence[Path] = ()) -> Undo:
        """``folders`` are ours (run folders, submitit's): their content is recorded. ``roots`` (the run root)
        may be shared with other runs and users: only whether they existed, and one made now goes only if empty."""
        undo = cls(new_roots=[root for root in dict.fromkeys(roots) if not os.path.lexists(root)])
        for folder in dict.fromkeys(folders):
            if os.path.islink(folder):
                continue  # refused before anything is written through it
            if os.path.lexists(folder):
                undo.before[folder] = _entries(folder)
            else:
                undo.created.append(folder)
        return undo

    def roll_back(self) -> None:
        for folder in self.created:
            if os.path.isdir(folder) and not os.path.islink(folder):
                shutil.rmtree(folder, ignore_errors=True)  # rmtree never follows links inside
        for folder, entries in self.before.items():
            now = _entries(folder)
            for relative in sorted(set(now) - set(entries), key=len, reverse=True):
                path = folder / relative
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            for relative, content in entries.items():
                if content is not None and now.get(relative) != content:
                    path = folder / relative
                    path.unlink(missing_ok=True)
                    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    with os.fdopen(descriptor, "wb") as handle:
                        handle.write(content)
        for root in self.new_roots:
            with contextlib.suppress(OSError):  # not empty: another submission uses it now
                os.rmdir(root)
