"""What ``ckpt export`` refuses before it hashes or loads anything: an output it cannot write as asked, and a
folder it cannot read (a user program's own). No torch: the command checks these on a login node first."""

from __future__ import annotations

import os
from pathlib import Path

from hpc_train.checkpoint.exported import sidecar_path
from hpc_train.checkpoint.manifest import Manifest
from hpc_train.errors import ConfigError

__all__ = ["check_engine", "check_out_folder", "check_out_path"]


def check_out_path(out: Path, force: bool, sidecar: bool = False) -> None:
    """Refuse an output path (and with ``sidecar`` its ``FILE.json``) that cannot be written as asked, before
    anything is loaded."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError("--out", f"the folder {parent} does not exist", f"create it (mkdir -p {parent}) or pick "
                          "a path in an existing folder")
    if out.is_dir():
        raise ConfigError("--out", f"{out} is a folder", "give a file name, like model.safetensors")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"the folder {parent} is not writable for you", "pick a folder you can write")
    for path in (out, sidecar_path(out)) if sidecar else (out,):
        if path.is_dir() and not path.is_symlink():
            raise ConfigError("--out", f"{path} is a folder", "pick another name")
        if (path.exists() or path.is_symlink()) and not force:
            raise ConfigError("--out", f"{path} already exists", "pick another name, or pass --force to replace it")


def check_out_folder(out: Path, force: bool) -> None:
    """Refuse an output folder (``--format hf``) that cannot be written as asked, before anything is loaded."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError("--out", f"the folder {parent} does not exist", f"create it (mkdir -p {parent})")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError("--out", f"{out} exists and is not a folder", "give a new folder name, like model-hf")
    if out.exists() and not force:
        raise ConfigError("--out", f"{out} already exists", "pick another name, or pass --force to replace it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"the folder {parent} is not writable for you", "pick a folder you can write")


def check_engine(folder: Path, manifest: Manifest) -> None:
    """Refuse a folder a user's program wrote through ``ctx.checkpoint``: it holds what each object's
    ``state_dict()`` gave, by the names the program chose, so export cannot tell which is the model. Checked before
    anything is hashed."""
    if manifest.engine == "program":
        raise ConfigError(str(folder), "was written by your program through ctx.checkpoint, so it holds your objects "
                          "by the names you saved them with, and export cannot tell which one is the model",
                          f"load rank 0's copy yourself: torch.load('{folder}/ranks/rank-0.pt', weights_only=True)"
                          "['objects'][NAME] is the state_dict() of what you saved as NAME (a DeepSpeed engine's "
                          "are under deepspeed/NAME/, an FSDP2 module's under dcp/)")
