"""The names inside a run's ``checkpoints/`` folder, defined once for every writer and reader: the step folders
(``step-00000100``), the folders a writer fills or throws away, ``latest``, and DeepSpeed's tag inside a step
folder. The manager writes them, ``ckpt ls``, ``status``, export and the engines' adapters read them."""

from __future__ import annotations

import re

__all__ = ["DEEPSPEED_TAG", "LATEST_NAME", "STEP_FOLDER", "TMP_FOLDER", "TRASH_FOLDER", "step_folder_name",
           "step_of"]

LATEST_NAME = "latest"  # a small file holding the newest committed step folder's name
DEEPSPEED_TAG = "state"  # DeepSpeed's tag inside a step folder (the folder's name already says the step)
STEP_FOLDER = re.compile(r"^step-([0-9]{8,30})$")
TMP_FOLDER = re.compile(r"^\.tmp-step-([0-9]{8,30})-([0-9]+)$")  # a writer is filling it, or crashed doing so
TRASH_FOLDER = re.compile(r"^\.trash-step-([0-9]{8,30})-([0-9]+)$")  # renamed first, so a delete is never half


def step_folder_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step a folder name (or ``latest``'s text) names; None for any other name."""
    match = STEP_FOLDER.match(name)
    return int(match[1]) if match else None
