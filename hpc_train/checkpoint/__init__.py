"""Checkpoints as transactions: folders of files sealed by a manifest, found again only when whole.

Importable without torch (``ckpt ls/verify`` run on login nodes); see :mod:`hpc_train.checkpoint.manager`.
"""

from hpc_train.checkpoint.manager import (
    LATEST_NAME,
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    VerifyLevel,
    inspect_checkpoint,
    step_folder_name,
)
from hpc_train.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, sha256_file

__all__ = ["LATEST_NAME", "MANIFEST_NAME", "CheckpointError", "CheckpointInfo", "CheckpointManager", "FileEntry",
           "Manifest", "VerifyLevel", "inspect_checkpoint", "sha256_file", "step_folder_name"]
