"""The checkpoint transaction every rank program shares, whatever its engine: rank 0 opens a temporary folder,
every rank writes its files into it (each hashed while written, through :class:`~hpc_train.checkpoint.rank_files.
RankFiles`; with ``checkpoint.async_save`` staged in memory and written by a thread), and rank 0 seals it
(manifest with every file's size and sha256, rename, ``latest`` last), in the background when the save is
asynchronous; a failure on any rank reaches every rank. :meth:`CheckpointTransaction.latest` finds the newest
checkpoint that verifies. What goes into the folder is the engine's business (the DeepSpeed trainer's
:class:`hpc_train.checkpoint.deepspeed.Checkpointer`, a program's ``ctx.checkpoint``)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpc_train.checkpoint import CheckpointError, CheckpointManager
from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.rank_files import WRITTEN_DIR, RankFiles, written_marker
from hpc_train.config.job import JobConfig
from hpc_train.control.written import WrittenWatch
from hpc_train.errors import ConfigError
from hpc_train.rank.distributed.collectives import broadcast_object, gather_objects
from hpc_train.rank.distributed.faults import injected_save_delay_s
from hpc_train.rank.runtime.cadence import PROBE_STEPS, SaveCadence
from hpc_train.rank.runtime.node_states import NodeStates
from hpc_train.run.attempts import AttemptLog, measured_save_s
from hpc_train.run.files import open_record
from hpc_train.run.paths import CHECKPOINTS_DIR

__all__ = ["CheckpointTransaction", "Refusal", "broadcast"]

# rank 0's line, once per attempt, when the ranks' written records of background saves come over the coordinator
WRITTEN_OVER_COORDINATOR = "the ranks tell rank 0 that their part of each background save is written over the job's " \
    "coordinator (no marker files)"
_MARKER_POLL_S = 0.02  # rank 0's commit thread looks for the ranks' written markers this often at first,
_MARKER_POLL_MAX_S = 0.25  # and at most this far apart while they are still writing


def broadcast(value: Any) -> Any:
    return broadcast_object(value, src=0)


@dataclass(frozen=True)
class Refusal:
    """Rank 0's reason not to resume, sent to the other ranks so that all stop with the same message."""

    message: str
    config_error: bool

    def error(self) -> Exception:
        if self.config_error:
            return ConfigError("", self.message)
        return CheckpointError(f"rank 0 could not prepare the checkpoint: {self.message}")


class _ToLog(logging.Handler):
    """The checkpoint manager's warnings (a checkpoint skipped on resume, and why) in the rank-0 log that
    ``hpc_train.submit`` follows, not only on the rank's stderr."""

    def __init__(self, log: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log(f"warning: {record.getMessage()}")


def _forward_manager_warnings(log: Callable[[str], None]) -> None:
    logger = logging.getLogger("hpc_train.checkpoint.manager")
    for handler in [h for h in logger.handlers if isinstance(h, _ToLog)]:
        logger.removeHandler(handler)
    logger.addHandler(_ToLog(log))



class CheckpointTransaction:
    """Rank 0 owns the checkpoint folder (one writer); every rank takes part in each save."""

    ENGINE = "program"  # what the manifest says wrote the folder (manifest.ENGINES); the trainer's engines override it

    def __init__(self, run_dir: Path, config: JobConfig, layout: Any, config_hash: str,
                 log: Callable[[str], None] | None = None) -> None:
        checkpoint = config.checkpoint
        self.run_dir = run_dir
        self.every = checkpoint.every_steps
        self.every_minutes = checkpoint.every_minutes  # 0: every_steps decides
        self.cadence: SaveCadence | None = None  # rank 0's clock when saves are timed (time_saves)
        self._timed_steps = 0
        self._next_due: int | None = None
        self._said = ""
        self.resume_enabled = checkpoint.resume
        self.memory: Any = None  # the DeepSpeed trainer's memory tier (its Checkpointer sets it)
        self.rank = dist.get_rank()
        # The trainer's progress log; by default the rank's own logger, which hpc_train.rank.entry sets up.
        self.log = log or logging.getLogger(f"hpc_train.rank{self.rank}").info
        self.manager = CheckpointManager(run_dir / CHECKPOINTS_DIR, keep=checkpoint.keep, verify=checkpoint.verify,
                                         background_prune=True) if self.rank == 0 else None
        self.world = dist.get_world_size()
        self.check_sha256 = checkpoint.verify == "sha256"
        self.write_timeout_s = float(config.watchdog.checkpoint_timeout_s)
        if self.manager:
            _forward_manager_warnings(self.log)
        self.fields = {"world_size": layout.world, "zero_stage": config.zero.stage, "engine": self.ENGINE,
                       "dtype": config.train.precision, "config_hash": config_hash,
                       "layout": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data,
                                  "context": layout.context}}
        self._error: Exception | None = None
        self.async_save = checkpoint.async_save
        self.files = RankFiles(self.rank, self.async_save)
        # each rank's small state (random generators) goes into one file per node of the layout
        self.node_states = NodeStates(self.rank, self.world, config.job.tasks_per_node, config.dist.timeout_s)
        self._committer: threading.Thread | None = None
        self._commit_error: BaseException | None = None
        self._written: WrittenWatch | None = None  # rank 0: the ranks' written records over the coordinator
        self._abandoned = threading.Event()  # the life failed (close): the commit thread seals nothing more
        self._written_tried = False

    def memory_due(self, step: int) -> bool:
        """Whether ``step`` is copied into memory (``checkpoint.memory_every_steps``: the DeepSpeed trainer's
        tier, :mod:`hpc_train.checkpoint.memory_tier`; no other engine has one)."""
        return self.memory is not None and self.memory.due(step)

    def save_to_memory(self, engine: Any, step: int, sampler_state: dict[str, int]) -> None:
        if self.memory is not None:
            self.memory.save(engine, step, sampler_state)

    def time_saves(self, node_mtbf_hours: float, nodes: int) -> None:
        """Every rank, before the steps: with ``checkpoint.every_minutes``, saves fall due at the step rank 0
        derives from its clock (:class:`~hpc_train.rank.runtime.cadence.SaveCadence`) rather than every N steps.
        ``"auto"`` starts from the save time an earlier attempt of this run measured."""
        if self.every_minutes and self.rank == 0:
            measured = measured_save_s(AttemptLog(self.run_dir).read())
            self.cadence = SaveCadence(self.every_minutes, node_mtbf_hours, nodes, measured)

    def due(self, step: int, last: int) -> bool:
        """Every rank, after each step, in the same order (with timed saves it may broadcast rank 0's decision)."""
        if step == last:
            return True
        if not self.every_minutes:
            return bool(self.every and step % self.every == 0)
        self._timed_steps += 1
        if self.cadence is not None:
            self.cadence.stepped()
        if self._next_due is None and self._timed_steps == PROBE_STEPS:
            self._decide(step)
        return step == self._next_due

    def saved(self, step: int, seconds: float) -> None:
        """Every rank, after a save that ``due`` asked for: what it cost the steps, and with timed saves the
        step of the next one (a broadcast)."""
        if not self.every_minutes:
            return
        if self.cadence is not None:
            self.cadence.saved(seconds)
        self._decide(step)

    def _decide(self, step: int) -> None:
        decided = None
        if self.cadence is not None:
            steps = self.cadence.steps_to_next()
            decided = step + steps
            said = self.cadence.describe(steps)
            if said != self._said:
                self.log(said)
                self._said = said
        self._next_due = broadcast(decided)

    def save_with(self, step: int, write: Callable[[Path], None], wait: bool = False,
                  stable: frozenset[int] = frozenset()) -> None:
        """Every rank calls ``write(folder)`` to put its files into the folder rank 0 opened (through
        ``self.files``, or any other way); rank 0 then seals it (manifest with every file's size and sha256,
        rename, ``latest``). With ``checkpoint.async_save`` and not ``wait``, ``self.files`` stages each file in
        memory and writes it in this rank's writer thread, and rank 0 commits in its own thread once every rank
        has said it is done; ``latest`` still moves only once everything is durable. A previous background save
        always finishes first, and its failure stops every rank here. ``stable``: storages that stay as they are
        until the caller's next :meth:`RankFiles.settle`, copied by the writer thread (``RankFiles.begin``)."""
        delay = injected_save_delay_s(self.rank)
        if delay:
            time.sleep(delay)  # an injected slow save (HPC_TRAIN_INJECT_FAULT=slow_save:R:MS)
        staged = self.async_save and not wait
        opened = broadcast(self._open(self.manager, step, staged) if self.manager else None)
        if isinstance(opened, Refusal):
            raise self._commit_error or opened.error()
        folder, save_id = opened
        tmp = Path(folder)
        self.files.begin(tmp, staged, save_id, stable)
        fields = {"step": step, **self.fields}
        if not staged:
            self._seal_together(tmp, fields, write)
            return
        write(tmp)
        if self.manager:  # rank 0 alone, off the training path; started before this rank's writer thread is busy,
            # whose Python would hold the interpreter lock up to 5 ms at a time from this thread's start
            self._committer = threading.Thread(target=self._commit, args=(self.manager, tmp, fields, save_id),
                                               name=f"commit-step-{step}", daemon=False)
            self._committer.start()
        self.files.announce()

    def latest(self, level: Any = None, skip: Collection[Path] = ()) -> Path | None:
        """Every rank: the newest checkpoint that verifies (rank 0 looks, falling back past damaged ones with a
        warning, and tells the others), or None; rank 0's error reaches every rank. ``level`` overrides
        ``checkpoint.verify`` (a loader that hashes while it reads asks for sizes); ``skip``: checkpoints a load
        already found damaged."""
        if not self.resume_enabled:
            return None
        found: Any = None
        if self.manager:
            try:
                newest = self.manager.latest_verified(level, skip)
                found = None if newest is None else str(newest)
            except Exception as error:
                found = Refusal(str(error), isinstance(error, ConfigError))
        found = broadcast(found)
        if isinstance(found, Refusal):
            raise found.error()
        return None if found is None else Path(found)

    def _seal_together(self, tmp: Path, fields: dict[str, Any], write: Callable[[Path], None]) -> None:
        """Every rank writes its files (each hashed and fsynced as it is written), rank 0 gathers their entries
        and commits: nothing is read back. A failure on any rank reaches every rank as the same error, instead
        of leaving the others in a collective until the timeout."""
        try:
            write(tmp)
            self.files.drain()
            mine: Any = list(self.files.entries)
        except Exception as error:
            mine = f"rank {self.rank}: {type(error).__name__}: {error}"
        shares = gather_objects(mine, dst=0)
        status = None
        if self.manager and shares is not None:
            problems = [share for share in shares if isinstance(share, str)]
            try:
                if problems:
                    raise CheckpointError(f"saving {tmp.name} failed on {'; '.join(problems)}")
                self.manager.commit(tmp, fields, sealed=[entry for share in shares for entry in share])
            except Exception as error:
                status = Refusal(str(error), False)
        status = broadcast(status)
        if isinstance(status, Refusal):
            raise status.error()

    def _open(self, manager: CheckpointManager, step: int, staged: bool) -> tuple[str, str] | Refusal:
        """Rank 0: wait for the previous background seal, then open the next temporary folder; and the id of this
        save that the ranks' written records of a background save carry over the coordinator (rank 0 watches
        it), or "" for marker files. An id of its own per save: a folder's name comes back when a step is saved
        again by the same process, and the coordinator still holds the records of the last save."""
        try:
            self._join()
            online = staged and self._watch_written() is not None
            return str(manager.begin(step)), f"{os.getpid()}-{uuid.uuid4().hex}" if online else ""
        except Exception as error:
            self._commit_error = error
            return Refusal(str(error), False)

    def _rewatch_written(self) -> WrittenWatch | None:
        """Rank 0's commit thread, when its watch broke during a save: a new one (None while it cannot connect:
        the next look tries again; the records the ranks told the coordinator are pushed again on the watch)."""
        if self._written is not None:
            self._written.close()
        if self._abandoned.is_set():  # close() ran meanwhile: a new watch would be left open
            self._written = None
            return None
        self._written = WrittenWatch.open()
        return self._written

    def _watch_written(self) -> WrittenWatch | None:
        """Rank 0's watch of the ranks' written records, opened at the first background save (None without a
        coordinator, or once it went away: marker files then)."""
        if self._written is not None and not self._written.usable:
            self._written.close()
            self._written, self._written_tried = None, False  # the coordinator went away: try once more
        if self._written is None and not self._written_tried:
            self._written_tried = True
            self._written = WrittenWatch.open()
            if self._written is not None:
                self.log(f"checkpoint: {WRITTEN_OVER_COORDINATOR}")
        return self._written

    def _commit(self, manager: CheckpointManager, tmp: Path, fields: dict[str, Any], save_id: str) -> None:
        """Rank 0's commit thread: wait for every rank's written record, then commit their entries."""
        try:
            sealed = self._written_entries(tmp, save_id)
            if self._abandoned.is_set():
                raise CheckpointError(f"{tmp.name} abandoned: the life that saved it failed")
            manager.commit(tmp, fields, sealed=sealed)
        except BaseException as error:  # reported to every rank by the next save or finish()
            self._commit_error = error

    def _written_entries(self, tmp: Path, save_id: str = "") -> list[FileEntry]:
        """The entries of every rank's written record (each rank's writer thread tells its own, on whatever node it
        runs: over the coordinator with ``save_id``, else as a marker file), or the first rank's error;
        ``.written/`` is removed before the commit lists the folder. Each look is what the coordinator pushed,
        one listing of ``.written/`` and a read of the markers new in it, never a stat per rank (16,384 of them
        every 20 ms at that size), and the looks back off to :data:`_MARKER_POLL_MAX_S` while the ranks write."""
        deadline = time.monotonic() + self.write_timeout_s
        records: dict[int, Any] = {}
        pause = _MARKER_POLL_S
        watch = self._written if save_id else None
        while len(records) < self.world:
            if self._abandoned.is_set():
                raise CheckpointError(f"{tmp.name} abandoned: the life that saved it failed")
            if save_id and (watch is None or not watch.usable):
                watch = self._rewatch_written()  # the coordinator pushes every record it holds again
            if watch is not None:  # in memory: the records the ranks told the coordinator
                records.update(watch.records(save_id, set(records), self.world))
            for rank in sorted(_marker_ranks(tmp / WRITTEN_DIR, self.world) - records.keys()):
                with open_record(written_marker(tmp, rank)) as handle:  # a rank that could not tell it
                    records[rank] = json.loads(handle.read())
            if len(records) < self.world:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world)) - set(records))
                    raise CheckpointError(f"ranks {missing[:8]} did not finish writing {tmp.name} within "
                                          f"{self.write_timeout_s:.0f} s (watchdog.checkpoint_timeout_s)")
                time.sleep(pause)
                pause = min(pause * 1.5, _MARKER_POLL_MAX_S)
        errors = [record["error"] for _rank, record in sorted(records.items()) if "error" in record]
        if errors:
            raise CheckpointError(f"writing {tmp.name} failed on {'; '.join(errors)}")
        if os.path.isdir(tmp / WRITTEN_DIR):  # none when every rank told the coordinator
            shutil.rmtree(tmp / WRITTEN_DIR)
        return [FileEntry.from_dict(item, f"rank {rank} marker") for rank, record in sorted(records.items())
                for item in record["files"]]

    def _join(self) -> None:
        if self._committer is not None:
            self._committer.join()
            self._committer = None
        if self._commit_error is not None:
            raise CheckpointError(f"sealing a checkpoint in the background failed: {self._commit_error}")

    def close(self) -> None:
        """After a failed life: this rank's writer thread ends once its queue is written and its buffers go (a
        rank that restarts inside its own process builds the next life's afresh); rank 0's commit thread seals
        nothing more (a warm rank 0 keeps its pid, and with it the name of the next life's folder for a step)."""
        self._abandoned.set()
        self.files.close()
        if self._written is not None:
            self._written.close()
            self._written = None

    def finish(self) -> None:
        """Every rank: return once rank 0's background seal (if any) is durable; raise its error on every rank.
        A program that destroyed its process group first (as torchrun scripts end) has each rank wait for its own
        files, rank 0 for the seal too, and only rank 0 raises its error: there is no group left to tell the
        others through (rank 0's seal needs no collective, only every rank's written marker)."""
        self.files.drain()
        status = None
        if self.manager:
            try:
                self._join()
                self.manager.wait()
            except CheckpointError as error:
                status = Refusal(str(error), False)
        if self._written is not None:  # the last save is sealed: rank 0's watch is not needed any more
            self._written.close()
            self._written, self._written_tried = None, False
        if dist.is_initialized():
            status = broadcast(status)
        if isinstance(status, Refusal):
            raise status.error()


def _marker_ranks(folder: Path, world: int) -> set[int]:
    """The ranks whose written marker (``rank-N.json``) is in ``folder`` now, from one listing; a marker still
    being written has a temporary name (``.rank-N.json.tmp-PID``) and is not one yet."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    ranks = set()
    for name in names:
        number = name[len("rank-"):-len(".json")] if name.startswith("rank-") and name.endswith(".json") else ""
        if number.isdigit() and len(number) <= 9 and int(number) < world:
            ranks.add(int(number))
    return ranks
