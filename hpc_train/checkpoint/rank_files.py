"""How a rank writes and reads the files of a checkpoint: once each, hashed on the way, in the background.

:class:`RankFiles` is one rank's part of a save. Every file goes through :func:`hpc_train.checkpoint.writer.write_file`
(``torch.save`` into a hashing, fsyncing writer), so the rank knows each file's size and sha256 when the file is
on disk and the commit reads nothing back. An engine's own files take the same path (DeepSpeed's through
:class:`hpc_train.checkpoint.deepspeed_files.FileCheckpointEngine`, its pluggable checkpoint engine).

Asynchronous saves (``checkpoint.async_save``): :meth:`RankFiles.save` copies the state into host memory (pinned
memory on a GPU, the copy queued on the current CUDA stream and waited for by the writer thread through an
event, so the step after the save does not wait for it; on a CPU a plain copy, or, for the storages the caller
says stay as they are until its next optimizer step, a copy the writer thread makes first, which that step waits
for through :meth:`RankFiles.settle`) and keeps it for the rank's writer thread; training goes on as soon as every
file is staged. When there is not enough free memory for the copy, that file is written at once instead.
:meth:`RankFiles.announce` hands the save's files to the writer thread and queues, after them,
``.written/rank-N.json`` (the entries, or the error), which rank 0's commit thread waits for; where the job has
a coordinator and rank 0 watches it, the same record goes over it instead (:mod:`hpc_train.control.written`).

Loading reads every file straight into its tensors (:mod:`hpc_train.checkpoint.verified_read`): size checked
against the manifest before a byte is read, sha256 too when ``checkpoint.verify = "sha256"``, hashed as the bytes
pass, with ``torch.load(weights_only=True)``, DeepSpeed's few non-tensor classes allowed by name (when it is
installed).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_train.checkpoint.manifest import FileEntry
from hpc_train.checkpoint.verified_read import verified
from hpc_train.checkpoint.writer import ViewReader, write_file
from hpc_train.control.written import publish_written
from hpc_train.run.files import atomic_write
from hpc_train.run.host_memory import available_memory

__all__ = ["WRITTEN_DIR", "RankFiles", "load_safely", "storage_of", "written_marker"]

log = logging.getLogger(__name__)

WRITTEN_DIR = ".written"  # per-rank completion markers of an asynchronous save, removed before the commit
_MEMORY_SHARE = 0.5  # stage a file only while it takes at most this share of the memory still available


def written_marker(folder: Path, rank: int) -> Path:
    return folder / WRITTEN_DIR / f"rank-{rank}.json"


def _safe_globals() -> list[Any]:
    """The non-tensor classes DeepSpeed pickles into its checkpoints (0.16-0.19), allowed for weights_only."""
    allowed: list[Any] = []
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            imported = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        allowed += [getattr(imported, name) for name in names if hasattr(imported, name)]
    return allowed


def load_safely(data: Any, map_location: Any = None) -> Any:
    """``torch.load`` of bytes already read and checked, with ``weights_only=True``; each record is copied once,
    into its tensor (:class:`~hpc_train.checkpoint.writer.ViewReader`)."""
    with memoryview(data) as view:
        return load_stream(ViewReader(view.cast("B")), map_location)


def load_stream(stream: Any, map_location: Any = None) -> Any:
    """``torch.load`` of a seekable binary file with ``weights_only=True`` and the globals DeepSpeed's
    checkpoints hold allowed."""
    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(stream, map_location=map_location, weights_only=True)


def _tensor_bytes(value: Any) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def storage_of(tensor: torch.Tensor) -> int:
    """What tells two tensors over the same memory apart from others: a state dict's views of a parameter share
    the parameter's storage, not its identity."""
    return int(tensor.untyped_storage().data_ptr())


class _Buffers:
    """The host buffers one file was staged into last time, handed out again in the same order when the next
    save stages the same file with the same shapes: no allocation per save (a fresh allocation is slow on a
    VM that handed the memory back, and pinned memory is slow to allocate on any GPU machine).

    ``stable``: storages of CPU tensors that nothing changes before the next optimizer step (the caller's
    promise, kept by :meth:`RankFiles.settle` before that step). Their copies are listed in ``later`` for the
    writer thread to make while training goes on; every other tensor is copied here."""

    def __init__(self, previous: list[torch.Tensor], pinned: bool, stable: frozenset[int] = frozenset()) -> None:
        self.previous = previous
        self.pinned = pinned
        self.stable = stable
        self.used: list[torch.Tensor] = []
        self.later: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, the tensor it copies)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        index = len(self.used)
        host = self.previous[index] if index < len(self.previous) else None
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                               pin_memory=self.pinned and tensor.device.type == "cuda")
        if tensor.device.type == "cpu" and self.stable and storage_of(tensor) in self.stable:
            self.later.append((host, tensor.detach()))
        else:
            # On a GPU the copy is queued on the current stream; the writer thread waits for the event recorded
            # after it.
            host.copy_(tensor.detach(), non_blocking=tensor.device.type == "cuda" and host.is_pinned())
        self.used.append(host)
        return host


def _stage(value: Any, buffers: _Buffers, memo: dict[int, Any] | None = None) -> Any:
    """A copy of ``value`` that no longer changes with training: tensors copied into host buffers, dicts, lists
    and tuples rebuilt around them, other mutable objects deep-copied. An object met twice is copied once (its
    pickle then holds one object and a reference, as the original's would); immutable tuple kinds (torch.Size,
    named tuples) stay as they are."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    kind = type(value)
    if torch.is_tensor(value):
        copied: Any = buffers.copy(value)
    elif kind is dict or kind is OrderedDict:
        copied = kind((key, _stage(item, buffers, memo)) for key, item in value.items())
    elif kind is list:
        copied = [_stage(item, buffers, memo) for item in value]
    elif kind is tuple:
        copied = tuple(_stage(item, buffers, memo) for item in value)
    elif value is None or isinstance(value, bool | int | float | complex | str | bytes | tuple | torch.dtype):
        return value
    else:
        try:  # a NumPy array, a set, an object of the user's: training may change it in place
            copied = copy.deepcopy(value)
        except (TypeError, copy.Error, RuntimeError):  # cannot be copied: written as it is then
            copied = value
    memo[id(value)] = copied
    return copied


_CLOSE_JOIN_S = 60.0  # close() waits this long at most for a write under way


def _end_of_writes() -> None:
    """The job that ends a writer thread (:meth:`RankFiles.close`)."""


class RankFiles:
    """One rank's files of the checkpoint being saved (entries for the manifest) or loaded (checked reads)."""

    def __init__(self, rank: int, async_save: bool) -> None:
        self.rank = rank
        self.async_save = async_save
        self.folder: Path | None = None
        self.entries: list[FileEntry] = []
        self._staging = False
        self._jobs: queue.Queue[tuple[bool, Callable[[], None]]] = queue.Queue()  # (run even after a failure, job)
        self._held: list[Callable[[], None]] = []  # the current save's writes, queued by announce()
        self._stable: frozenset[int] = frozenset()  # the current save's storages copied later (_Buffers)
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []  # the current save's copies made later
        self._copied: threading.Event | None = None  # set once the writer thread made them
        self.settle_wait_s = 0.0  # how long settle() waited for them, in all (the benchmark's stall counts it)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reading: tuple[Path, dict[str, FileEntry], bool] | None = None
        self.load_problems: list[str] = []
        self._buffers: dict[str, list[torch.Tensor]] = {}  # staging buffers per file, reused by the next save
        self._save_id = ""  # the current save's id: its written record goes over the coordinator

    # ----- saving -----

    def begin(self, folder: Path, staged: bool, save_id: str = "", stable: frozenset[int] = frozenset()) -> None:
        """Start this rank's part of the save into ``folder``; ``staged``: write it in the background; ``save_id``:
        rank 0 hears this rank's written record, carrying it, over the coordinator (no marker file); ``stable``:
        storages of CPU tensors that stay as they are until the caller calls :meth:`settle` (before its next
        optimizer step), copied by the writer thread while training goes on rather than in the save call."""
        self.settle()
        self.drain()
        self.folder, self.entries, self._error, self._held, self._later = folder, [], None, [], []
        self._staging = staged and self.async_save
        self._stable = stable if self._staging else frozenset()
        self._save_id = save_id

    def save(self, state: Any, path: Path) -> None:
        """``torch.save(state, path)`` as part of the current save: hashed while written, or staged."""
        folder, relative = self._folder(), self.relative(path)
        if self._staging and self._fits(state, relative):
            on_gpu = any(torch.is_tensor(t) and t.device.type == "cuda" for t in _leaves(state))
            buffers = _Buffers(self._buffers.get(relative, []), pinned=on_gpu, stable=self._stable)
            copy = _stage(state, buffers)
            self._buffers[relative] = buffers.used
            self._later += buffers.later
            event = torch.cuda.Event() if on_gpu else None
            if event is not None:
                event.record()  # the host copies are done when this event is: the writer waits for it
            self._held.append(lambda: self._write(folder, relative, copy, event))
        elif self._staging:  # too big to stage: DeepSpeed skipped its clone for us, so make it here
            from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

            self._write(folder, relative, clone_tensors_for_torch_save(state), None)
        else:
            self._write(folder, relative, state, None)

    def save_built(self, build: Callable[[], Any], path: Path) -> None:
        """``torch.save(build(), path)`` as part of the current save, ``build`` called by the writer thread when the
        save is staged: for a state made fresh from values that do not change (the node's gathered random
        states), which needs no copy and whose making need not hold up training."""
        folder, relative = self._folder(), self.relative(path)
        if self._staging:
            self._held.append(lambda: self._write(folder, relative, build(), None))
        else:
            self._write(folder, relative, build(), None)

    def after(self, wait: Callable[[], Any]) -> None:
        """Files a library writes in the background itself (DCP's asynchronous save): the writer thread calls
        ``wait()`` (the library's future) before this rank's marker, so rank 0 commits only once they are on disk;
        what ``wait`` raises is reported through the marker like a failed write. Queued at once, not held: the
        library writes already, and a save that fails before announce() must still wait for it."""
        self._start()
        self._jobs.put((False, wait))

    def announce(self) -> None:
        """After this rank's last file of an asynchronous save: its staged files go to the writer thread, then
        its marker for rank 0's commit thread. The writes wait until every file is staged: a writer that
        pickled and hashed the first file while the training thread copied the next would share the rank's
        core with that copy and lengthen the save call (measured: the optimizer's copy took twice as long)."""
        folder = self._folder()
        self._start()
        held, self._held = self._held, []
        if self._later:  # first in the queue: the copies the next optimizer step waits for (settle)
            copied, later = threading.Event(), self._later
            self._copied, self._later = copied, []
            self._jobs.put((True, lambda: _copy_all(later, copied)))
        for job in held:
            self._jobs.put((False, job))
        self._jobs.put((True, lambda: self._mark(folder)))

    def settle(self) -> None:
        """Return once the writer thread made the current save's later copies (``stable`` of :meth:`begin`):
        called before anything changes what they copy (the optimizer's step, a load)."""
        copied = self._copied
        if copied is None:
            return
        if not copied.is_set():
            start = time.perf_counter()
            copied.wait()
            self.settle_wait_s += time.perf_counter() - start
        self._copied = None

    def drain(self) -> None:
        """Wait until every queued write of this rank is on disk (the marker too)."""
        if self._thread is not None:
            self._jobs.join()

    @property
    def staging(self) -> bool:
        """Whether the current save stages its files (DeepSpeed then need not clone its state first)."""
        return self._staging

    def _fits(self, state: Any, relative: str) -> bool:
        available = available_memory()
        needed = _tensor_bytes(state) - sum(t.numel() * t.element_size() for t in self._buffers.get(relative, []))
        if available is None or needed <= available * _MEMORY_SHARE:
            return True
        log.warning("checkpoint: %.1f GB to stage, %.1f GB of memory available: writing this file before training "
                    "goes on", needed / 1e9, available / 1e9)
        return False

    def _write(self, folder: Path, relative: str, state: Any, event: Any) -> None:
        if event is not None:
            event.synchronize()
        entry = write_file(folder, relative, lambda sink: torch.save(state, sink))
        self.entries.append(entry)

    def _mark(self, folder: Path) -> None:
        record: dict[str, Any] = {"rank": self.rank}
        if self._error is not None:
            record["error"] = f"rank {self.rank}: {type(self._error).__name__}: {self._error}"
        else:
            record["files"] = [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in self.entries]
        if self._save_id and publish_written(self.rank, self._save_id, record):
            return  # rank 0 has it in memory: no file created, renamed and removed on the metadata server
        marker = written_marker(folder, self.rank)
        marker.parent.mkdir(mode=0o700, exist_ok=True)
        atomic_write(marker, json.dumps(record) + "\n")

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=f"checkpoint-writer-rank{self.rank}", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """End the writer thread (a write under way finishes, what is queued is dropped) and let go of the staging
        buffers: a rank that restarts inside its own process (a warm restart) builds the next life's files afresh,
        and a thread left waiting on this queue would keep this object and its buffers for the rest of the
        process, or go on writing into a folder the next life makes again."""
        thread, self._held, self._later = self._thread, [], []
        if thread is not None and thread.is_alive():
            while True:  # what is queued is the failed life's: never written
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
                self._jobs.task_done()
            self._jobs.put((True, _end_of_writes))
            thread.join(timeout=_CLOSE_JOIN_S)  # a write under way finishes first
        if self._copied is not None:  # its copies were dropped above: nothing may wait for them
            self._copied.set()
        self._thread, self._buffers, self._copied = None, {}, None

    def _run(self) -> None:
        while True:
            always, job = self._jobs.get()
            if job is _end_of_writes:
                self._jobs.task_done()
                return
            try:
                if always or self._error is None:  # after a failure only the marker (which reports it) and copies
                    job()
            except BaseException as error:  # reported to rank 0 through the marker, then to every rank
                self._error = error
                log.error("checkpoint: writing in the background failed on rank %d: %s", self.rank, error)
            finally:
                self._jobs.task_done()

    def relative(self, path: Path) -> str:
        """``path``'s name inside the current save's folder, as the manifest lists it."""
        return _relative_to(path, self._folder())

    def _folder(self) -> Path:
        if self.folder is None:
            raise RuntimeError("RankFiles.save outside a checkpoint save (begin() first)")
        return self.folder

    # ----- loading -----

    def begin_load(self, folder: Path | None, entries: list[FileEntry], check_sha256: bool) -> None:
        """Loads below ``folder`` are checked against ``entries`` (None: a folder without a manifest, read as it
        is). A file whose sha256 differs is still deserialized and handed back (the load it is part of has
        collectives every rank must reach) and its problem kept in ``load_problems`` for the ranks to agree on."""
        self._reading = None if folder is None else (folder, {e.path: e for e in entries}, check_sha256)

    def load(self, path: Path, map_location: Any = None) -> Any:
        """Read ``path`` once, check it against the manifest, then deserialize it with ``weights_only=True``."""
        entry, check, relative = None, False, str(path)
        if self._reading is not None:
            folder, entries, check = self._reading
            with contextlib.suppress(ValueError):  # not below the checked folder: nothing to check it against
                relative = _relative_to(path, folder)
            entry = entries.get(relative)
        with verified(Path(path), entry, check) as reader:
            value = load_stream(reader, map_location)
            if not reader.finish():
                self.load_problems.append(f"{relative} is corrupt: sha256 differs from the manifest")
        return value


def _relative_to(path: Path, folder: Path) -> str:
    return Path(os.path.abspath(path)).relative_to(os.path.abspath(folder)).as_posix()


def _copy_all(later: list[tuple[torch.Tensor, torch.Tensor]], copied: threading.Event) -> None:
    """The writer thread's first job of a save: the copies the save call left to it; ``copied`` is set whatever
    happens, so that no optimizer step waits for ever (a failed copy fails the save through the marker)."""
    try:
        for host, source in later:
            host.copy_(source)
    finally:
        copied.set()


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]
