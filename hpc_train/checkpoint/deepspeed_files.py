"""DeepSpeed's files of a checkpoint through the rank runtime's :class:`~hpc_train.checkpoint.rank_files.RankFiles`:
hashed while written, staged for the background with ``checkpoint.async_save``, read once and checked when
loaded. :class:`FileCheckpointEngine` is DeepSpeed's pluggable checkpoint engine, installed on an engine before a
save or a load. :func:`stable_until_step` names what an asynchronous save may copy after its call returns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from hpc_train.checkpoint.rank_files import WRITTEN_DIR, RankFiles, load_safely, written_marker

__all__ = ["WRITTEN_DIR", "FileCheckpointEngine", "RankFiles", "install_file_engine", "load_safely",
           "stable_until_step", "written_marker"]

_WRAPPERS = 4  # DeepSpeed's optimizers wrap torch's at most this deep (ZeRO, fp16, bf16 wrappers)
# DeepSpeed's wrappers (0.16-0.19) that change the parameters and their optimizer state only in or after the torch
# optimizer's step; any other (ZenFlow's CPU step, a wrapper of a later release) copies in the save call
_KNOWN_WRAPPERS = frozenset({"DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer",
                             "FP16_Optimizer", "FP16_UnfusedOptimizer"})


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


def torch_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO's, fp16's, bf16's): its step is where the engine's
    parameters and optimizer state change."""
    optimizer = getattr(engine, "optimizer", None)
    for _ in range(_WRAPPERS):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            break
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def stable_until_step(engine: Any) -> tuple[list[torch.Tensor], torch.optim.Optimizer | None]:
    """The CPU tensors that stay as they are until the torch optimizer's next step (the module's parameters, the
    optimizer's parameters, such as ZeRO's fp32 partitions, and its state), and that optimizer. The module's
    buffers are not among them: a forward pass may change them (a norm's running statistics). Nothing where that
    cannot be told: no torch optimizer inside, a wrapper not known to step only through it, Muon (whose momentum
    DeepSpeed writes before that step), or ZeRO-Infinity's NVMe offload, whose host buffers hold other tensors in
    turn."""
    optimizer, wrapper = torch_optimizer(engine), getattr(engine, "optimizer", None)
    known = isinstance(wrapper, torch.optim.Optimizer) or (type(wrapper).__name__ in _KNOWN_WRAPPERS
                                                            and not getattr(wrapper, "zenflow", False))
    if optimizer is None or not known or _nvme(engine) or _muon(optimizer):
        return [], None
    tensors = list(engine.module.parameters()) + [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return [t for t in tensors if t.device.type == "cpu" and t.numel()], optimizer


def _nvme(engine: Any) -> bool:
    """ZeRO-Infinity's NVMe offload of the optimizer or the parameters: host buffers swapped between tensors."""
    param = getattr(engine, "zero_offload_param", lambda: None)()
    return bool(getattr(engine, "zero_nvme_offload_optimizer", lambda: False)()) or \
        getattr(getattr(param, "device", None), "value", None) == "nvme"


def _muon(optimizer: torch.optim.Optimizer) -> bool:
    """DeepSpeed's Muon (0.19) writes its momentum in the ZeRO wrapper's step, before the torch optimizer's."""
    return "muon" in type(optimizer).__name__.lower() or \
        any(group.get("use_muon") for group in optimizer.param_groups)
