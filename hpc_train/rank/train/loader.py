"""This rank's batches: any map-style dataset through a ``DataLoader`` (workers, pinned memory, prefetch),
in the order of the resumable sampler, with a position that stays exact across requeues.

Why the position is counted here and not read from the loader: workers load batches ahead (``num_workers x
prefetch_factor`` of them), so what the loader has fetched is not what the model has seen. The sampler is
deterministic, so the loader's index stream is a copy of it started at the saved position, and a second copy
advances only when the trainer takes a batch; that copy's state is what a checkpoint records. A dataset whose
item ``i`` depends only on ``i`` then resumes bit for bit, with workers or without, at any data-parallel size
whose global batch divides the position (as :class:`~hpc_train.rank.train.data.ResumableSampler` says).
"""

from __future__ import annotations

import copy
import functools
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hpc_train.config.job import DataSection
from hpc_train.rank.runtime.entry_points import UserCodeError
from hpc_train.rank.train.data import ResumableSampler, TokenSource

__all__ = ["BatchStream", "LoaderSettings", "TokenDataset", "checked_dataset", "to_device"]


class TokenDataset(Dataset):
    """A built-in token source as a map-style dataset: item ``i`` is ``(inputs, targets)``, int64 tensors of
    ``seq_len`` tokens, the targets shifted by one."""

    def __init__(self, source: TokenSource, seq_len: int) -> None:
        self.source, self.seq_len = source, seq_len

    def __len__(self) -> int:
        return self.source.num_samples(self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.source.sample(int(index), self.seq_len)
        if row.shape != (self.seq_len + 1,):
            raise ValueError(f"sample {index} has shape {row.shape}, expected ({self.seq_len + 1},)")
        tokens = torch.from_numpy(row)
        return tokens[:-1], tokens[1:]


@dataclass(frozen=True)
class LoaderSettings:
    """``[data]``'s DataLoader settings, the collate function (None: torch's default), and the signals workers
    ignore (see :func:`_ignore_signals`)."""

    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 0
    persistent_workers: bool = False
    collate: Callable[[list[Any]], Any] | None = None
    ignore_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    @classmethod
    def from_section(cls, data: DataSection, collate: Callable[[list[Any]], Any] | None,
                     preemption_signals: tuple[int, ...] = ()) -> LoaderSettings:
        ignored = cls.ignore_signals + preemption_signals
        return cls(data.num_workers, data.pin_memory, data.prefetch_factor, data.persistent_workers, collate,
                   tuple(dict.fromkeys(ignored)))


def _ignore_signals(signals: tuple[int, ...], worker_id: int) -> None:
    """A worker's first act: ignore the signals Slurm (and Ctrl-C) send to every process of the job. The
    training process handles them (agree, save, requeue) and then stops its workers; a worker killed by
    Slurm's SIGTERM instead would make torch raise "DataLoader worker is killed" in the training process
    before it has saved. A worker still leaves when its training process is gone (torch watches the parent)."""
    del worker_id
    for number in signals:
        signal.signal(number, signal.SIG_IGN)


def checked_dataset(dataset: Any, said: str, global_batch: int) -> Any:
    """``dataset`` if it is a map-style dataset of at least one global batch; UserCodeError naming ``said``."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise UserCodeError(f"{said} returned {type(dataset).__name__}, not a map-style dataset (with __len__ and "
                            "__getitem__): hpc_train addresses samples by index to resume them exactly")
    try:
        length = len(dataset)
    except Exception as error:
        raise UserCodeError(f"{said}: len() of the {type(dataset).__name__} it returned raised "
                            f"{type(error).__name__}: {error}", error) from error
    if length < global_batch:
        raise UserCodeError(f"{said} returned a dataset of {length} samples, fewer than one global batch of "
                            f"{global_batch}; give it more samples, or lower train.micro_batch or train.grad_accum")
    return dataset


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (in dicts, lists and tuples, nested) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device, non_blocking) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple keeps its type
        return type(batch)(*(to_device(value, device, non_blocking) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(value, device, non_blocking) for value in batch)
    return batch


class _IndexBatches:
    """The DataLoader's batch sampler: this rank's micro-batches of indices, without end, from a copy of the
    position the stream had when its loader started."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        sampler = copy.deepcopy(self.sampler)
        while True:
            yield sampler.next_indices()


class BatchStream:
    """This rank's batches on ``device``, resumable: ``state_dict()`` is the position of the batches taken."""

    def __init__(self, dataset: Any, sampler: ResumableSampler, settings: LoaderSettings, device: torch.device,
                 seed: int) -> None:
        self.dataset, self.position, self.settings, self.device, self.seed = dataset, sampler, settings, device, seed
        self._batches: Iterator[Any] | None = None
        self._pin = settings.pin_memory and device.type == "cuda"

    def _loader(self) -> DataLoader:
        workers = self.settings.num_workers
        extra: dict[str, Any] = {}
        if workers:
            extra = {"persistent_workers": self.settings.persistent_workers,
                     "prefetch_factor": self.settings.prefetch_factor or 2}
            extra["worker_init_fn"] = functools.partial(_ignore_signals, self.settings.ignore_signals)
        return DataLoader(self.dataset, batch_sampler=_IndexBatches(copy.deepcopy(self.position)),
                          num_workers=workers, collate_fn=self.settings.collate, pin_memory=self._pin,
                          generator=torch.Generator().manual_seed(self.seed), **extra)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            self._batches = iter(self._loader())
        batch = next(self._batches)
        self.position.next_indices()  # the batch is taken: the saved position moves past it
        return to_device(batch, self.device, non_blocking=self._pin)

    def state_dict(self) -> dict[str, int]:
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; a loader already started is dropped (its workers stop)."""
        self.position.load_state_dict(state)
        self.close()

    def close(self) -> None:
        """Stop the workers now (the next batch starts new ones): before a requeue, whose SIGTERM reaches every
        process of the job, and at the end of training."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
