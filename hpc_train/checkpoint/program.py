"""``ctx.checkpoint``: a user program's state saved and loaded through the rank runtime's checkpoint transaction.

Each rank writes ``ranks/rank-N.pt`` (the ``state_dict()`` of each object it was given, tensors and plain values
as they are, and every random generator of the rank), each DeepSpeed engine saves itself under
``deepspeed/NAME/``, and an FSDP2 module (``fully_shard``) with the optimizers in ``state`` goes through
``torch.distributed.checkpoint`` into ``dcp/`` (every rank its own shards); rank 0 then seals the folder
(manifest with sizes and sha256, rename, ``latest`` last, ``checkpoint.keep``, in the background with
``checkpoint.async_save``). Files load with ``weights_only=True``.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.checkpoint import MANIFEST_NAME, CheckpointError, Manifest
from hpc_train.checkpoint.dcp_state import DCP_DIR
from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.names import DEEPSPEED_TAG
from hpc_train.checkpoint.transaction import CheckpointTransaction
from hpc_train.rank.distributed.collectives import all_gather_objects
from hpc_train.rank.runtime import random_state
from hpc_train.rank.runtime.stopping import AttemptRecorder

__all__ = ["UserCheckpoint"]

RANKS_DIR = "ranks"
ENGINES_DIR = "deepspeed"


def _is_engine(value: Any) -> bool:
    """A DeepSpeed engine saves and loads its own (sharded) state, collectively."""
    return type(value).__module__.startswith("deepspeed") and hasattr(value, "save_checkpoint") \
        and hasattr(value, "load_checkpoint")


def _install(engine: Any, checkpointer: CheckpointTransaction) -> None:
    """A DeepSpeed engine's files go through this rank's RankFiles (the DeepSpeed adapter is the trainer's, and is
    imported only when a program hands over an engine, so deepspeed is already there)."""
    from hpc_train.checkpoint.deepspeed_files import install_file_engine

    install_file_engine(engine, checkpointer.files)


def _sharded(state: MutableMapping[str, Any]) -> tuple[str | None, list[str]]:
    """The FSDP2 module of ``state`` (its name) and the optimizers saved with it through DCP, or (None, [])."""
    from torch.distributed.fsdp import FSDPModule

    modules = sorted(name for name, value in state.items() if isinstance(value, FSDPModule))
    if len(modules) > 1:
        raise ValueError(f"ctx.checkpoint: {', '.join(modules)} are FSDP2 modules; give the one root module that "
                         "fully_shard was called on last")
    if not modules:
        return None, []
    return modules[0], sorted(name for name, value in state.items() if isinstance(value, torch.optim.Optimizer))


def _dcp_save(state: MutableMapping[str, Any], module: str, optimizers: list[str], folder: Path,
              entries: list[FileEntry]) -> None:
    """The FSDP2 module and its optimizers as one distributed checkpoint: every rank writes its own shards, each
    hashed while written into ``entries`` (this rank's manifest entries)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hpc_train.checkpoint.dcp_files import hashing_writer

    model, optim = get_state_dict(state[module], [state[name] for name in optimizers])
    where = folder / DCP_DIR
    dcp.save({"model": model, "optimizers": optim}, storage_writer=hashing_writer(where, folder, entries),
             checkpoint_id=str(where))


def _dcp_load(state: MutableMapping[str, Any], module: str, optimizers: list[str], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    chosen = [state[name] for name in optimizers]
    model, optim = get_state_dict(state[module], chosen)
    loaded = {"model": model, "optimizers": optim}
    dcp.load(loaded, checkpoint_id=str(folder / DCP_DIR))
    set_state_dict(state[module], chosen, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizers"])


def _agree(problem: str | None) -> None:
    """Every rank raises the same error when any rank found a problem, instead of some waiting in a collective."""
    found = [p for p in all_gather_objects(problem) if p]
    if found:
        raise CheckpointError(found[0])


class UserCheckpoint:
    """``ctx.checkpoint.save(step, state)`` and ``ctx.checkpoint.load(state)``; both are collective."""

    def __init__(self, checkpointer: CheckpointTransaction, device: torch.device, recorder: AttemptRecorder,
                 progress: Callable[[str, int], None], log: Callable[[str], None],
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self._checkpointer = checkpointer
        self._device = device
        self._recorder = recorder
        self._progress = progress
        self._log = log
        self._stopping = stopping  # True once should_stop() said so: that save is durable before it returns
        self.rank = dist.get_rank()

    def save(self, step: int, state: MutableMapping[str, Any]) -> None:
        """Save ``state`` (names to modules, optimizers, schedulers, samplers, DeepSpeed engines, tensors or
        plain values) as the checkpoint of ``step``, with every rank's random state."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint.save: step must be an int >= 0, got {step!r}")
        self._progress("checkpoint", step)
        started = time.perf_counter()

        module, optimizers = _sharded(state)

        def write(folder: Path) -> None:
            for name in sorted(state):
                if _is_engine(state[name]):
                    _install(state[name], self._checkpointer)
                    state[name].save_checkpoint(str(folder / ENGINES_DIR / name), tag=DEEPSPEED_TAG)
            if module is not None:
                _dcp_save(state, module, optimizers, folder, self._checkpointer.files.entries)
            held = {module, *optimizers}
            objects = {name: value.state_dict() if hasattr(value, "state_dict") else value
                       for name, value in state.items() if not _is_engine(value) and name not in held}
            payload = {"step": step, "objects": objects, "random": random_state.capture(self._device)}
            self._checkpointer.files.save(payload, folder / RANKS_DIR / f"rank-{self.rank}.pt")

        self._checkpointer.save_with(step, write, wait=self._stopping())
        self._recorder.save_time(time.perf_counter() - started)
        self._progress("step", step)

    def finish(self) -> None:
        """Collective: the last background save is durable (committed, ``latest`` moved), or its error raised on
        every rank. The program's session calls it when the program returns."""
        self._checkpointer.finish()

    def load(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest verified checkpoint into ``state``'s objects in place (plain values are replaced in
        the mapping) and restore every rank's random state; return its step, or None when there is none."""
        self._progress("checkpoint", 0)
        found = self._checkpointer.latest()
        if found is None:
            self._progress("startup", 0)  # nothing loaded: still starting, until the first log or should_stop
            return None
        payload, problem = self._read(found, state)
        _agree(problem)
        for name in sorted(state):
            if _is_engine(state[name]):
                _install(state[name], self._checkpointer)
                state[name].load_checkpoint(str(found / ENGINES_DIR / name), tag=DEEPSPEED_TAG)
        module, optimizers = _sharded(state)
        if module is not None:
            _dcp_load(state, module, optimizers, found)
        for name, value in list(state.items()):
            if _is_engine(value) or name in (module, *optimizers):
                continue
            saved = payload["objects"][name]
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(saved)
            elif isinstance(value, torch.Tensor):
                with torch.no_grad():
                    value.copy_(saved)
            else:
                state[name] = saved
        random_state.restore(payload["random"], self._device)
        step = int(payload["step"])
        self._recorder.resumed(step)
        self._log(f"resumed from step {step} ({found.name})")
        self._progress("step", step)
        return step

    def _read(self, found: Path, state: MutableMapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """This rank's part of ``found``, or why it cannot be loaded into ``state``."""
        manifest = Manifest.from_json((found / MANIFEST_NAME).read_text(encoding="utf-8"))
        world = dist.get_world_size()
        if manifest.world_size != world:
            return {}, (f"checkpoint {found.name} was saved by {manifest.world_size} ranks and this job has {world}: "
                        "ctx.checkpoint keeps one file per rank, so resume on the same number of ranks (or set "
                        "checkpoint.resume = false to start over)")
        try:
            payload = torch.load(found / RANKS_DIR / f"rank-{self.rank}.pt", map_location="cpu", weights_only=True)
        except (OSError, pickle.UnpicklingError, RuntimeError) as error:
            return {}, f"checkpoint {found.name}: rank {self.rank} cannot read its state ({error})"
        engines = {name for name, value in state.items() if _is_engine(value)}
        module, optimizers = _sharded(state)
        in_dcp = {module, *optimizers} if module is not None else set()
        missing = sorted(set(state) - engines - in_dcp - set(payload["objects"]))
        if module is not None and not (found / DCP_DIR).is_dir():
            missing.append(module)
        missing += sorted(name for name in engines if not (found / ENGINES_DIR / name).is_dir())
        if missing:
            held = sorted(payload["objects"]) + sorted(p.name for p in (found / ENGINES_DIR).glob("*"))
            return {}, (f"checkpoint {found.name} holds no {', '.join(missing)} (it holds "
                        f"{', '.join(held) or 'nothing'}): load with the names it was saved with")
        return payload, None
