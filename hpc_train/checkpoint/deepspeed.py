"""Saving and resuming a training run through the transactional checkpoint manager.

The DeepSpeed trainer's part over the rank runtime's transaction (:mod:`hpc_train.checkpoint.transaction`): every rank
writes its DeepSpeed shards into the temporary folder rank 0 opened (and the first rank of each node the random
states of the node's ranks), each file hashed while written (:mod:`hpc_train.checkpoint.deepspeed_files`: DeepSpeed's
files through our checkpoint engine); rank 0 then commits the ranks' entries (manifest, rename, ``latest``). On
start, rank 0 picks the newest checkpoint whose files have their sizes and every rank loads it, each file read once:
the model, optimizer and scheduler through DeepSpeed (with fp16 the loss scaler, which DeepSpeed keeps in the
optimizer's state), the sampler's position and the step from the client state, and each rank's random state (Python,
NumPy, torch and, on a GPU, CUDA).

A checkpoint saved at another data-parallel size (same tensor and pipeline sizes) is resumed through DeepSpeed's
universal checkpoint: rank 0 converts it once into ``checkpoints/.universal/`` while the other ranks wait
(:mod:`hpc_train.checkpoint.universal`), and every rank loads that copy with ``load_universal`` switched on for this
one load. Nothing else needs converting: the sampler's state is the global position ``(epoch, offset)`` in
samples, the same on every rank and independent of the data-parallel size (:class:`ResumableSampler`), so the
run goes on with the next unseen sample of the global stream; a rank that did not exist at save time is in no
file of ``rng/`` and keeps its freshly seeded random state. A change of a model axis is refused, on every
rank, before anything is loaded.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpc_train.checkpoint import MANIFEST_NAME, CheckpointError, CheckpointManager, Manifest
from hpc_train.checkpoint.deepspeed_files import install_file_engine, stable_until_step
from hpc_train.checkpoint.manager import inspect_checkpoint
from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.memory_store import why_memory_tier_off
from hpc_train.checkpoint.memory_tier import MemoryTier, resume_from_memory
from hpc_train.checkpoint.names import DEEPSPEED_TAG, step_of
from hpc_train.checkpoint.rank_files import storage_of
from hpc_train.checkpoint.transaction import CheckpointTransaction, Refusal, broadcast
from hpc_train.checkpoint.universal import (
    cached_copy,
    clear_cache,
    compare_layouts,
    convert_to_universal,
    describe_layout,
    optimizer_is_partitioned,
)
from hpc_train.config.job import JobConfig
from hpc_train.errors import ConfigError
from hpc_train.rank.distributed.collectives import all_gather_objects
from hpc_train.rank.runtime import random_state
from hpc_train.run.in_place import IN_PLACE_ENV

__all__ = ["Checkpointer"]

# Rank 0 converts while the others wait in a collective: it gives up a little before they would time out.
_CONVERT_SHARE_OF_TIMEOUT = 0.9
_CONVERT_WORKERS = 4


@dataclass(frozen=True)
class _Load:
    """What rank 0 chose to resume from, sent to every rank: the sealed folder (random states, and the load
    itself unless converted) and the folder DeepSpeed loads."""

    sealed: str
    load_dir: str
    universal: bool


@contextmanager
def _universal_load(engine: Any, universal: bool) -> Iterator[None]:
    """DeepSpeed reads ``checkpoint.load_universal`` from its config at load time only (ZeRO keeps the
    bookkeeping a universal load needs in any case), so it is switched for this one load, not for the run."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def _repair_zero3_universal_load(engine: Any, copy: Path) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal load (0.19) that would make the run drift from an
    uninterrupted one: every parameter group gets the settings of the first (so the biases and norms kept free of
    weight decay would decay), and all groups share one ``step`` tensor (which Adam then advances once per group
    per step). ZeRO 1-2 load both right."""
    if engine.zero_optimization_stage() != 3:
        return
    # weights_only, with the two DeepSpeed classes this file pickles allowed by name: nothing else can run.
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum]):
        state = torch.load(copy / DEEPSPEED_TAG / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=True)
    optimizer = engine.optimizer.optimizer
    saved, groups = state["param_groups"], optimizer.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(f"{copy}: {len(saved)} optimizer parameter groups saved, {len(groups)} in this model")
    for group, settings in zip(groups, saved, strict=True):
        group.update({key: value for key, value in settings.items() if key != "params"})
    for param_state in optimizer.state.values():
        if torch.is_tensor(param_state.get("step")):
            param_state["step"] = param_state["step"].clone()


class Checkpointer(CheckpointTransaction):
    """The transaction with DeepSpeed's engine in it: the trainer's save and its resume (at the same layout, or
    through a universal checkpoint at another data-parallel size)."""

    ENGINE = "deepspeed"

    def __init__(self, run_dir: Path, config: JobConfig, layout: Any, config_hash: str,
                 log: Callable[[str], None] | None = None) -> None:
        super().__init__(run_dir, config, layout, config_hash, log)
        self.convert_timeout_s = config.dist.timeout_s * _CONVERT_SHARE_OF_TIMEOUT
        # the memory tier, where the ranks run under node agents (a restart in place) and the plan allows it
        self.memory_applies = IN_PLACE_ENV in os.environ and not why_memory_tier_off(config, layout.tensor,
                                                                                      layout.pipeline)
        self.memory = MemoryTier.from_env(config.checkpoint.memory_every_steps, self.rank,
                                          config.job.tasks_per_node, self.log) \
            if self.memory_applies else None
        self._settle_hook: tuple[Any, weakref.ref[Any]] | None = None  # (its handle, the optimizer it is on)
        self._stable_kept: list[torch.Tensor] = []  # the last save's stable tensors, kept until the next one

    def close(self) -> None:
        super().close()
        self._unhook()
        if self.memory is not None:
            self.memory.files.close()

    def _unhook(self) -> None:
        if self._settle_hook is not None:
            self._settle_hook[0].remove()
            self._settle_hook = None
        self._stable_kept = []

    def _stable(self, engine: Any) -> frozenset[int]:
        """An asynchronous save's copies of the parameters and optimizer state are made by the writer thread while
        the next step's forward and backward run (they change only in the optimizer's step, which waits for them
        through a step pre-hook: :meth:`RankFiles.settle`); the save call copies the rest (CheckFreq's pipelined
        snapshot). On a GPU those copies are already queued on the stream, not made in the call."""
        tensors, optimizer = stable_until_step(engine)
        if optimizer is None:
            return frozenset()
        if self._settle_hook is None or self._settle_hook[1]() is not optimizer:
            self._unhook()
            files = self.files
            self._settle_hook = (optimizer.register_step_pre_hook(lambda *_: files.settle()), weakref.ref(optimizer))
        self._stable_kept = tensors  # their storages stay theirs (no other tensor takes an address) until copied
        return frozenset(storage_of(tensor) for tensor in tensors)

    def install(self, engine: Any) -> None:
        """DeepSpeed writes and reads this engine's files through this rank's :class:`RankFiles`: hashed while
        written, staged for the background with ``async_save``, read once and checked when loaded."""
        install_file_engine(engine, self.files)

    def save(self, engine: Any, step: int, sampler_state: dict[str, int], wait: bool = False) -> None:
        """The trainer's save: DeepSpeed's shards with the step and sampler in the client state, and each rank's
        random state (:mod:`hpc_train.rank.runtime.random_state`, :meth:`save_with`), one file per node
        (``rng/ranks-FIRST-LAST.pt``, :mod:`hpc_train.rank.runtime.node_states`)."""
        self.install(engine)
        stable = self._stable(engine) if self.async_save and not wait else frozenset()

        def write(tmp: Path) -> None:
            # the node's ranks meet first, before any file: a rank whose write fails leaves no peer in this gather
            states = self.node_states.gather_later(lambda: random_state.capture(engine.device))
            engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, client_state={"step": step, "sampler": sampler_state})
            if states is not None:
                self.files.save_built(states, tmp / "rng" / self.node_states.file_name)

        self.save_with(step, write, wait, stable)

    def resume(self, engine: Any) -> tuple[int, dict[str, int] | None]:
        """(the last completed step, the sampler state) of the newest good checkpoint, or (0, None).

        Rank 0 picks the newest checkpoint whose files have the manifest's sizes; every rank then reads its own
        files once, checking each one's sha256 on the way with ``checkpoint.verify = "sha256"``. A rank that
        finds a damaged file still finishes the load (DeepSpeed's collectives must not be left half way), then
        all ranks agree and load the previous good checkpoint over it. The sampler state is the global sample
        position, valid at any data-parallel size (see the module doc).
        """
        self.files.settle()  # a load writes into the tensors a background save may still be copying
        if not self.resume_enabled:
            return 0, None
        partial = None  # a memory load that failed part way: the disk checkpoint loads over it
        if self.memory_applies:
            disk_step = broadcast(self._newest_disk_step() if self.manager else 0)
            resumed = resume_from_memory(self.memory, engine, disk_step, self.rank, self.world, self.log,
                                         self.check_sha256)
            if isinstance(resumed, tuple):
                return resumed
            partial = resumed
            if partial and self.rank == 0:
                self.log(f"warning: memory tier: the load failed part way ({partial}); loading the disk checkpoint "
                         "over it")
        self.install(engine)
        damaged: list[str] = []
        while True:
            # The other ranks wait here while rank 0 checks sizes (and converts, for another layout).
            chosen = broadcast(self._choose(self.manager, damaged) if self.manager else None)
            if isinstance(chosen, Refusal):
                raise self._error or chosen.error()
            if chosen is None:
                if damaged:
                    raise CheckpointError(f"every checkpoint failed verification while it was loaded "
                                          f"({', '.join(Path(d).name for d in damaged)}); the model is partly "
                                          "loaded, so the run stops: set checkpoint.resume = false to start over")
                if partial:
                    raise CheckpointError(f"the memory tier's load failed part way ({partial}) and there is no disk "
                                          "checkpoint to load over it, so the run stops: set "
                                          "checkpoint.resume = false to start over")
                return 0, None
            problem, client = self._load(engine, chosen)
            problems = [p for p in all_gather_objects(problem) if p]
            if not problems:
                return int(client["step"]), client["sampler"]
            if self.manager:
                self.log(f"warning: checkpoint {chosen.sealed} skipped: {problems[0]}; falling back to the previous "
                         "one")
            damaged.append(chosen.sealed)

    def _newest_disk_step(self) -> int:
        """Rank 0: the step of the newest checkpoint on disk whose files have their sizes (0: none)."""
        try:
            found = self.manager.latest_verified(level="size") if self.manager else None
        except (OSError, CheckpointError):
            return 0
        return (step_of(found.name) or 0) if found is not None else 0

    def _load(self, engine: Any, chosen: _Load) -> tuple[str | None, dict[str, Any]]:
        """Load ``chosen`` on this rank; a file that fails its sha256 is reported, not raised."""
        sealed = Path(chosen.sealed)
        entries = list(Manifest.from_json((sealed / MANIFEST_NAME).read_text(encoding="utf-8")).files)
        self.files.load_problems.clear()
        try:
            # A universal copy has no manifest: rank 0 verified its source before converting it.
            self.files.begin_load(None if chosen.universal else sealed, entries, self.check_sha256)
            with _universal_load(engine, chosen.universal):
                _, client = engine.load_checkpoint(chosen.load_dir, tag=DEEPSPEED_TAG)
            if chosen.universal:
                _repair_zero3_universal_load(engine, Path(chosen.load_dir))
            self.files.begin_load(sealed, entries, self.check_sha256)
            self._load_rng(sealed, engine.device, entries)
        finally:
            self.files.begin_load(None, [], False)
        problems = self.files.load_problems
        return (f"{problems[0]} (found by rank {self.rank} while loading)" if problems else None), client

    def _load_rng(self, sealed: Path, device: torch.device, entries: list[FileEntry]) -> None:
        """This rank's random state from its node's file (or an older checkpoint's ``rng/rank-N.pt``), found among
        the files the manifest lists; a rank that did not exist when the checkpoint was saved has none."""
        names = [entry.path.removeprefix("rng/") for entry in entries if entry.path.startswith("rng/")]
        state = self.node_states.pick(sealed / "rng", self.files.load, names=names)
        if state is not None:
            random_state.restore(state, device)

    def _choose(self, manager: CheckpointManager, damaged: list[str]) -> _Load | Refusal | None:
        """Rank 0: the checkpoint to load and how, or why not; any error goes to every rank, not only to this one.
        Sizes are checked here; sha256, when configured, while every rank reads its files."""
        try:
            while True:
                found = manager.latest_verified(level="size", skip=[Path(d) for d in damaged])
                if found is None:
                    return None
                problem = self._source_problem(found)
                if problem is None:
                    return self._plan(manager, found)
                self.log(f"warning: checkpoint {found} skipped: {problem}; falling back to the previous one")
                damaged.append(str(found))
        except Exception as error:
            self._error = error
            return Refusal(str(error), isinstance(error, ConfigError))

    def _source_problem(self, found: Path) -> str | None:
        """With sha256 on, a checkpoint that must be converted (another layout) is hashed whole first: the
        conversion reads it with DeepSpeed's own loader, not through the checked reads of :meth:`_load`."""
        if not self.check_sha256:
            return None
        manifest = Manifest.from_json((found / MANIFEST_NAME).read_text(encoding="utf-8"))
        if not compare_layouts(f"checkpoint {found}", manifest.layout, manifest.world_size, self.fields["layout"],
                               self.fields["world_size"]):
            return None
        return inspect_checkpoint(found, "sha256")[1]

    def _plan(self, manager: CheckpointManager, found: Path) -> _Load:
        """Load ``found`` as it is when the layout is the same, else (data-parallel size only) its universal form."""
        manifest = Manifest.from_json((found / MANIFEST_NAME).read_text(encoding="utf-8"))
        world, layout = self.fields["world_size"], self.fields["layout"]
        if not compare_layouts(f"checkpoint {found}", manifest.layout, manifest.world_size, layout, world):
            clear_cache(manager.root)
            return _Load(str(found), str(found), universal=False)
        head = f"checkpoint {found.name} was saved by {describe_layout(manifest.layout, manifest.world_size)}"
        now = describe_layout(layout, world)
        if not optimizer_is_partitioned(found / DEEPSPEED_TAG):
            self.log(f"{head}; its optimizer state is whole (ZeRO stage 0), so it loads as it is on {now}")
            return _Load(str(found), str(found), universal=False)
        copy = cached_copy(found, DEEPSPEED_TAG)
        if copy is not None:
            self.log(f"{head}; loading the universal checkpoint converted from it earlier for {now}")
        else:
            self.log(f"{head}; converting to a universal checkpoint for {now}")
            copy, _seconds = convert_to_universal(found, DEEPSPEED_TAG, timeout_s=self.convert_timeout_s,
                                                  workers=min(_CONVERT_WORKERS, len(os.sched_getaffinity(0))))
        return _Load(str(found), str(copy), universal=True)
