"""The DeepSpeed trainer's memory tier (``[checkpoint] memory_every_steps``): every N steps each rank copies its
state into its node's memory (:mod:`hpc_train.checkpoint.memory_store`), which its agent holds past the rank's
death and copies to another node's agent; a restart in place resumes from the newest step every rank holds in
memory, and from the disk checkpoint only where memory has nothing as new.

What a rank writes is DeepSpeed's own checkpoint of it (through :class:`RankFiles`, staged: training goes on while
a thread writes the files), and its random state beside it. With ZeRO 0-2 the module is whole on every rank, so
its file is written once per node, by the node's first rank, and a rank whose copy lacks it links that rank's at
the restart (fetched with it where the node was lost); with ZeRO-3 every rank writes its own, as on disk. The load
is DeepSpeed's ``load_checkpoint`` of the rank's folder: the same code as the disk resume, so the run goes on
bitwise as it would have.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.deepspeed_files import RankFiles, install_file_engine
from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.memory_store import (
    MEMORY_ADDRESS_ENV,
    MEMORY_DIR_ENV,
    Copy,
    NodeStore,
    StoreError,
    available_memory,
    common_step,
    read_files_list,
    write_files_list,
)
from hpc_train.checkpoint.memory_transfer import TransferError, fetch_step
from hpc_train.checkpoint.names import DEEPSPEED_TAG
from hpc_train.control.discovery import CONTROL_TOKEN_ENV
from hpc_train.rank.distributed.collectives import all_gather_objects, all_reduce_values
from hpc_train.rank.runtime import random_state
from hpc_train.run.in_place import IN_PLACE_ENV

__all__ = ["RNG_NAME", "MemoryTier", "choose_memory_step", "resume_from_memory"]

RNG_NAME = "rng.pt"
_MEMORY_SHARE = 0.5  # a snapshot is skipped where it would take more than this share of the memory left


def _room_left(folder: Path) -> int | None:
    """What the node can still take into ``folder``: the smaller of its free memory and the tmpfs's free space."""
    available = available_memory()
    try:
        stat = os.statvfs(folder)
        free = stat.f_bavail * stat.f_frsize
    except OSError:
        return available
    return free if available is None else min(available, free)


class _SealingFiles(RankFiles):
    """:class:`RankFiles` whose last act of a save seals the step's folder (``files.json``, then the rename)
    instead of reporting to rank 0: memory needs no commit, a restart takes the newest step every rank sealed."""

    def __init__(self, rank: int, store: NodeStore, copy_of: Callable[[], Copy], log: Callable[[str], None]) -> None:
        super().__init__(rank, async_save=True)
        self.store, self.copy_of, self.note = store, copy_of, log
        self.sealed_bytes = 0

    def save(self, state: Any, path: Path) -> None:
        """As :meth:`RankFiles.save`, staged, but a file that cannot be staged is dropped with the copy, never
        written on the training thread and never raised: a rank that raised here would leave the others in
        DeepSpeed's save, and a copy that does not fit has no business taking the memory anyway."""
        if self._error is not None:
            return
        try:
            relative = self.relative(path)
            if not self._fits(state, relative):
                raise MemoryError("not enough free memory to stage it")
            super().save(state, path)
        except Exception as error:  # reported once, by the seal: the copy is dropped, the previous one stays
            self._error = error

    def _mark(self, folder: Path) -> None:
        if self._error is not None:
            self.note(f"memory tier: rank {self.rank}'s copy of step {self.copy_of()[0]} failed ({self._error}); the "
                      "previous one stays")
            shutil.rmtree(folder, ignore_errors=True)
            return
        write_files_list(folder, [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.entries])
        self.store.seal(folder, self.copy_of())
        self.store.prune("own", self.rank)
        self.store.prune("fetched", self.rank, keep=0)  # a copy fetched at the last restart: this one is newer
        self.sealed_bytes = sum(e.size for e in self.entries)


class MemoryTier:
    """One rank's memory tier: :meth:`save` every ``every`` steps, :func:`resume_from_memory` at the start."""

    def __init__(self, store: NodeStore, address: str, token: str, rank: int, every: int,
                 log: Callable[[str], None], life: int = 0, per_node: int = 1) -> None:
        self.store, self.address, self.token = store, address, token
        self.rank, self.every, self.log, self.life = rank, every, log, life
        self.per_node = max(1, per_node)
        self.first = rank - rank % self.per_node  # the first rank of this rank's node: it copies the module
        self._problem = ""
        self._copy: Copy = (0, life)
        self.files = _SealingFiles(rank, store, lambda: self._copy, log)
        self.skipped_for_room = False
        store.clear_unsealed("own", rank)

    @classmethod
    def from_env(cls, every: int, rank: int, per_node: int, log: Callable[[str], None],
                 env: Mapping[str, str] | None = None) -> MemoryTier | None:
        """The tier where this rank's agent keeps one (it set :data:`MEMORY_DIR_ENV`), else None."""
        env = os.environ if env is None else env
        path = env.get(MEMORY_DIR_ENV)
        if every <= 0 or not path:
            return None
        try:
            store = NodeStore.opened(path)
        except (StoreError, OSError) as error:
            log(f"warning: memory tier off on rank {rank}: {error}")
            return None
        life = env.get(IN_PLACE_ENV, "0")
        return cls(store, env.get(MEMORY_ADDRESS_ENV, ""), env.get(CONTROL_TOKEN_ENV, ""), rank, every, log,
                   int(life) if life.isdigit() else 0, per_node)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, engine: Any, step: int, sampler_state: dict[str, int]) -> None:
        """Copy this rank's state at ``step`` into the node's memory; every rank calls it at the same step
        (DeepSpeed's save has collectives). The files are written by a thread while training goes on."""
        self.files.drain()  # the previous copy is sealed (or failed) before the next one starts
        copy = (step, self.life)
        try:
            tmp: Path | None = self.store.begin("own", self.rank, copy)
        except OSError as error:  # /dev/shm full, the folder gone: said with the room, agreed by every rank
            tmp, self._problem = None, str(error)
        if not self._room(engine, step, tmp is not None):
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            return
        self._copy = copy
        self.files.begin(tmp, staged=True)
        install_file_engine(engine, self.files)
        writer = engine.save_non_zero_checkpoint
        # ZeRO 0-2: the module's file (whole on every rank) once per node; ZeRO-3: every rank's own, as on disk
        engine.save_non_zero_checkpoint = writer or self.rank == self.first
        try:
            engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, client_state={"step": step, "sampler": sampler_state},
                                   save_latest=False)
        finally:
            engine.save_non_zero_checkpoint = writer
        self.files.save(random_state.capture(engine.device), tmp / RNG_NAME)
        self.files.announce()

    def _room(self, engine: Any, step: int, ready: bool = True) -> bool:
        """Whether every rank's node has room for this copy: the node's ranks' copies together (each as big as
        this rank's last, or 4 bytes a parameter before the first) within half of what the node's memory and
        ``/dev/shm`` can still take. The ranks agree (DeepSpeed's save has collectives, so all copy or none does);
        said once each time it changes."""
        needed = self.per_node * (self.files.sealed_bytes or 4 * sum(
            getattr(p, "ds_numel", p.numel()) * p.element_size() for p in engine.module.parameters()))
        available = _room_left(self.store.root)
        fits_here = ready and (available is None or needed <= available * _MEMORY_SHARE)
        fits = bool(all_reduce_values([1 if fits_here else 0], op="min")[0])
        if fits == self.skipped_for_room:
            self.skipped_for_room = not fits
            where = (f"{self._problem}" if not ready else
                     f"{needed / 1e9:.2f} GB to copy on this node, {(available or 0) / 1e9:.2f} GB of memory left"
                     if not fits_here or fits else "another rank's node lacks the memory")
            self.log(f"memory tier: {'skipping' if not fits else 'copying again from'} step {step} on rank "
                     f"{self.rank}: {where}" + ("; a restart reads the disk checkpoint" if not fits else ""))
        return fits

    def finish(self) -> None:
        self.files.drain()

    def record(self) -> dict[str, Any]:
        """What this rank tells the others at a restart: where its node's memory is served, what it holds."""
        return {"address": self.address, "held": self.store.holdings()}

    def folder_for(self, copy: Copy, sources: list[str], rank: int | None = None) -> tuple[Path | None, str]:
        """Rank ``rank``'s (this rank's) sealed folder of ``copy``: on this node, or fetched from a node that holds
        its replica; (folder, where) or (None, why not)."""
        rank = self.rank if rank is None else rank
        found = self.store.find(rank, copy)
        if found is not None:
            return found, found.parent.parent.name  # own, replica or fetched (in an earlier life)
        problems = []
        for address in sources:
            try:
                return fetch_step(address, self.token, rank, copy, self.store), "fetched"
            except TransferError as error:
                problems.append(f"{address}: {error}")
        return None, f"rank {rank}'s step {copy[0]}: " + ("; ".join(problems) or "no node holds it")

    def module_into(self, folder: Path, copy: Copy, sources: list[str]) -> tuple[list[FileEntry], str | None]:
        """ZeRO 0-2: the module's file, which only the first rank of a node copies, linked into this rank's
        ``folder`` from that rank's copy (on this node after the first phase of a restart, else fetched); the
        entries to check it against (from that rank's ``files.json``), and the problem if any."""
        if self.rank == self.first or any(_is_module(entry.path) for entry in _entries(folder)):
            return [], None  # a first rank's copy, or ZeRO-3's own module file: listed in this rank's files.json
        first, how = self.folder_for(copy, sources, rank=self.first)
        if first is None:
            return [], how
        entries = [entry for entry in _entries(first) if _is_module(entry.path)]
        if not entries:
            return [], f"rank {self.first}'s step {copy[0]} holds no module file"
        for entry in entries:
            try:
                os.link(first / entry.path, folder / entry.path)
            except FileExistsError:
                pass  # linked at an earlier restart from this copy
            except OSError as error:
                return [], f"rank {self.first}'s module file cannot be linked here: {error}"
        return entries, None


def _is_module(path: str) -> bool:
    return path.startswith(f"{DEEPSPEED_TAG}/") and path.endswith("model_states.pt")


def _complete(folder: Path, entries: list[FileEntry]) -> str | None:
    """Why ``folder`` cannot be loaded (a file of ``files.json`` missing or of another size), or None: settled
    before the load, whose collectives every rank must reach."""
    if not any(entry.path == RNG_NAME for entry in entries):
        return f"{folder} has no files.json, or no random state in it"
    for entry in entries:
        try:
            size = (folder / entry.path).stat().st_size
        except OSError:
            return f"{folder / entry.path} is missing"
        if size != entry.size:
            return f"{folder / entry.path} has {size} bytes, not {entry.size}"
    return None


def _sources(records: list[dict[str, Any]], world: int
             ) -> tuple[dict[int, set[Copy]], dict[tuple[int, Copy], list[str]]]:
    """Each rank's copies on any node, and the nodes' addresses that hold each."""
    held: dict[int, set[Copy]] = {}
    where: dict[tuple[int, Copy], list[str]] = {}
    for record in records:
        for rank, copies in record["held"].items():
            if 0 <= int(rank) < world:
                held.setdefault(int(rank), set()).update(tuple(copy) for copy in copies)
                for copy in copies:
                    where.setdefault((int(rank), tuple(copy)), []).append(record["address"])
    return held, where


def choose_memory_step(records: list[dict[str, Any]], world: int, disk_step: int) -> tuple[Copy | None, str]:
    """The copy (step, life) to resume from memory (None: the disk decides), and what rank 0 says about it (""
    for nothing: a first life, whose memory is empty). ``records``: every rank's :meth:`MemoryTier.record`."""
    held, _where = _sources(records, world)
    copy, missing = common_step(held, world)
    disk = f"step {disk_step}" if disk_step else "none: from step 0"
    if copy is None:
        if not held:
            return None, ""
        return None, (f"memory tier: no step is held in memory for every rank (rank(s) "
                      f"{', '.join(map(str, missing[:8]))} have none in common with the others: their node's memory "
                      f"and its replica are gone, or were full); resuming from the disk checkpoint ({disk})")
    if copy[0] < disk_step:
        return None, (f"memory tier: memory holds step {copy[0]}, the disk checkpoint step {disk_step} is newer: "
                      "resuming from disk")
    return copy, ""


def _module_files(folder: Path) -> list[Path]:
    """DeepSpeed's module file(s) of a copy (``mp_rank_00_model_states.pt``; ZeRO-3's ``zero_pp_rank_*``)."""
    return sorted((folder / DEEPSPEED_TAG).glob("*model_states.pt"))


def _entries(folder: Path) -> list[FileEntry]:
    return [FileEntry(str(e["path"]), int(e["size"]), str(e["sha256"])) for e in read_files_list(folder)]


def _load(tier: MemoryTier, engine: Any, folder: Path, check_sha256: bool,
          entries: list[FileEntry]) -> tuple[str | None, dict[str, Any]]:
    """DeepSpeed's load of this rank's folder, each file checked against ``entries`` (its ``files.json``, and the
    module's file linked from the node's first rank); (problem, client)."""
    files = RankFiles(tier.rank, async_save=False)
    try:
        files.begin_load(folder, entries, check_sha256)
        install_file_engine(engine, files)
        _, client = engine.load_checkpoint(str(folder), tag=DEEPSPEED_TAG)
        random_state.restore(files.load(folder / RNG_NAME), engine.device)
    except Exception as error:  # reported to every rank; the disk checkpoint loads over what was loaded
        return f"rank {tier.rank}: {type(error).__name__}: {error}", {}
    finally:
        files.begin_load(None, [], False)
    problems = files.load_problems
    if client is None:
        return f"rank {tier.rank}: DeepSpeed found no checkpoint in {folder}", {}
    return (f"rank {tier.rank}: {problems[0]}" if problems else None), client


def _own_folder(tier: MemoryTier, copy: Copy, where: dict[tuple[int, Copy], list[str]]) -> tuple[Path | None, str]:
    """First phase of a restart: this rank's own folder of ``copy`` on this node, fetched if need be."""
    try:
        return tier.folder_for(copy, [a for a in where.get((tier.rank, copy), []) if a != tier.address])
    except Exception as error:  # never out of here alone: the others wait in the gather that follows
        return None, f"rank {tier.rank}: {type(error).__name__}: {error}"


def _with_module(tier: MemoryTier, folder: Path, copy: Copy, where: dict[tuple[int, Copy], list[str]]
                 ) -> tuple[list[FileEntry], str | None]:
    """Second phase, once every rank has its own folder (the node's first rank's among them): the module's file
    linked in, and every file checked present with its size; (entries to load with, problem)."""
    try:
        linked, problem = tier.module_into(folder, copy, [a for a in where.get((tier.first, copy), [])
                                                          if a != tier.address])
        entries = _entries(folder) + linked
        return entries, problem or _complete(folder, entries)
    except Exception as error:
        return [], f"rank {tier.rank}: {type(error).__name__}: {error}"


def _agreed(problem: str | None, step: int, rank: int, log: Callable[[str], None]) -> bool:
    """Every rank's word that it may load (a collective); rank 0 says the first problem."""
    problems = [p for p in all_gather_objects(problem) if p]
    if problems and rank == 0:
        log(f"memory tier: step {step} could not be gathered ({problems[0]}); resuming from the disk checkpoint")
    return not problems


def resume_from_memory(tier: MemoryTier | None, engine: Any, disk_step: int, rank: int, world: int,
                       log: Callable[[str], None], check_sha256: bool = False
                       ) -> tuple[int, dict[str, int]] | str | None:
    """Every rank: (step, sampler state) when the run resumed from memory; None when it did not (nothing was
    loaded: the disk checkpoint decides); the problem when a load failed part way (the disk must load over it).

    Every rank calls it, with or without a tier of its own: a rank whose node keeps none turns it off for all."""
    records = all_gather_objects(tier.record() if tier is not None else None)
    if any(record is None for record in records):
        off = [r for r, record in enumerate(records) if record is None]
        if rank == 0 and len(off) < world:
            log(f"warning: memory tier off: rank(s) {', '.join(map(str, off[:8]))} have no node memory")
        if tier is not None:
            tier.every = 1 << 62  # no rank copies any more: they would not meet in DeepSpeed's save
        return None
    copy, said = choose_memory_step(records, world, disk_step)
    if said and rank == 0:
        log(said)
    if copy is None:
        return None
    step = copy[0]
    _held, where = _sources(records, world)
    started = time.perf_counter()
    folder, how = _own_folder(tier, copy, where) if tier else (None, "no memory")
    outcomes = all_gather_objects((folder is not None, how))
    failed = [text for found, text in outcomes if not found]
    if failed:
        if rank == 0:
            log(f"memory tier: step {step} could not be gathered ({failed[0]}); resuming from the disk checkpoint")
        return None
    fetched = [text for _found, text in outcomes]
    entries, problem = _with_module(tier, folder, copy, where) if tier and folder else ([], "no folder")
    if not _agreed(problem, step, rank, log):
        return None
    problem, client = _load(tier, engine, folder, check_sha256, entries) if tier and folder else ("no folder", {})
    problems = [p for p in all_gather_objects(problem) if p]
    if problems:
        return problems[0]
    if rank == 0:
        counts = {kind: sum(1 for h in fetched if h == kind) for kind in ("own", "replica", "fetched")}
        log(f"resumed from memory at step {step} in {time.perf_counter() - started:.2f} s: {counts['own']} rank(s) "
            f"from their node's memory, {counts['replica'] + counts['fetched']} from a replica on another node "
            f"({counts['fetched']} fetched over the network); the newest disk checkpoint: "
            + (f"step {disk_step}" if disk_step else "none"))
    return int(client["step"]), client["sampler"]
