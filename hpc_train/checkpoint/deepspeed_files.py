"""DeepSpeed's files of a checkpoint through the rank runtime's :class:`~hpc_train.checkpoint.rank_files.RankFiles`:
hashed while written, staged for the background with ``checkpoint.async_save``, read once and checked when
loaded. :class:`FileCheckpointEngine` is DeepSpeed's pluggable checkpoint engine, installed on an engine before a
save or a load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from hpc_train.checkpoint.rank_files import WRITTEN_DIR, RankFiles, load_safely, written_marker

__all__ = ["WRITTEN_DIR", "FileCheckpointEngine", "RankFiles", "install_file_engine", "load_safely",
           "written_marker"]


class FileCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine that writes and reads through :class:`RankFiles`."""

    def __init__(self, files: RankFiles) -> None:
        super().__init__()
        self.name = "hpc_train"
        self.files = files

    def create(self, info: Any) -> None:
        """The folder is the one the Checkpointer opened."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, mode=0o700, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        self.files.save(state_dict, Path(path))

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.files.load(Path(path), map_location)

    def commit(self, info: Any) -> bool:
        """The Checkpointer commits the whole folder, for every rank at once."""
        return True

    def preserves_storage_sharing(self) -> bool:
        """True makes DeepSpeed clone the module's state before saving it (so that a view does not drag its
        whole flat buffer into the file); a staged save copies every tensor anyway, so that copy is skipped."""
        return not self.files.staging


def install_file_engine(engine: Any, files: RankFiles) -> None:
    """DeepSpeed writes and reads ``engine``'s files through ``files`` (once: a second call changes nothing)."""
    current = getattr(engine, "checkpoint_engine", None)
    if not isinstance(current, FileCheckpointEngine) or current.files is not files:
        engine.checkpoint_engine = FileCheckpointEngine(files)
