"""The ``[data]`` section on a rank: the training stream and the evaluation batches, from a built-in token
source or the user's ``dataset(ctx, split)``, through :mod:`hpc_train.rank.train.loader`.

The user's dataset and collate function are imported when the data is made (after the model's factory, before
the first step); ``dataset(ctx, "eval")`` is asked for only when evaluation is on, and may return None for no
evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_train.config.job import DATA_SOURCES
from hpc_train.config.program import parse_entry_point
from hpc_train.rank.distributed.context import RankContext
from hpc_train.rank.distributed.mesh import ParallelGroups
from hpc_train.rank.runtime.entry_points import UserCodeError, load_callable
from hpc_train.rank.train.data import ResumableSampler, make_source
from hpc_train.rank.train.loader import BatchStream, LoaderSettings, TokenDataset, checked_dataset

__all__ = ["EVAL_SEED_OFFSET", "RankData", "build_data"]

EVAL_SEED_OFFSET = 7919  # the evaluation's sample order: another permutation than training's, the same each time


@dataclass
class RankData:
    """The training stream, and a function that gives a fresh stream over the same evaluation batches (None:
    no evaluation set)."""

    train: BatchStream
    eval_stream: Callable[[], BatchStream | None]


def _collate(entry: str) -> Callable[[list[Any]], Any] | None:
    if not entry:
        return None
    return load_callable("data.collate", parse_entry_point("data.collate", entry, ("",)), ("samples",))


def _user_datasets(ctx: RankContext, entry: str, global_batch: int,
                   eval_batch: int) -> tuple[Any, Callable[[], Any]]:
    """The user's training set, and a function that asks for the evaluation set once."""
    dataset = load_callable("data.source", parse_entry_point("data.source", entry, DATA_SOURCES), ("ctx", "split"))

    def split(name: str) -> Any:
        said = f'data.source {entry}: dataset(ctx, "{name}")'
        try:
            made = dataset(ctx, name)
        except Exception as error:
            raise UserCodeError(f"{said} raised {type(error).__name__}: {error}", error) from error
        if made is None and name == "eval":
            return None
        return checked_dataset(made, said, eval_batch if name == "eval" else global_batch)

    held: list[Any] = []

    def evaluation() -> Any:
        if not held:
            held.append(split("eval"))
        return held[0]

    return split("train"), evaluation


def build_data(ctx: RankContext, groups: ParallelGroups, device: Any,
               preemption_signals: tuple[int, ...] = ()) -> RankData:
    """This rank's data for ``ctx.config``: its data-parallel slice of every global batch, on ``device``; loader
    workers ignore ``preemption_signals`` (the training process handles them)."""
    config = ctx.config
    train, data = config.train, config.data
    settings = LoaderSettings.from_section(data, _collate(data.collate), preemption_signals)
    dp_rank, dp_size = groups.coord("dp"), groups.size("dp")
    if data.source in DATA_SOURCES:
        tokens = TokenDataset(make_source(data.source, data.path, data.vocab_size, train.seed), train.seq_len)
        training, evaluation = tokens, (lambda: tokens)
    else:
        training, evaluation = _user_datasets(ctx, data.source, train.micro_batch * dp_size * train.grad_accum,
                                              train.micro_batch * dp_size)

    def stream(dataset: Any, seed: int, grad_accum: int) -> BatchStream:
        sampler = ResumableSampler(len(dataset), dp_rank, dp_size, train.micro_batch, seed=seed,
                                   grad_accum=grad_accum)
        return BatchStream(dataset, sampler, settings, device, seed)

    in_process = dataclasses.replace(settings, num_workers=0, prefetch_factor=0, persistent_workers=False)

    def eval_stream() -> BatchStream | None:
        """The evaluation's few micro-batches, loaded in the training process: worker processes started for
        them cost more than they save, and each would be a fork of a process whose threads (W&B, the checkpoint
        writer, the coordinator's reader) may hold a lock the child then waits on for ever."""
        dataset = evaluation()
        if dataset is None:
            return None
        sampler = ResumableSampler(len(dataset), dp_rank, dp_size, train.micro_batch, seed=train.seed +
                                   EVAL_SEED_OFFSET, grad_accum=1)
        return BatchStream(dataset, sampler, in_process, device, train.seed + EVAL_SEED_OFFSET)

    return RankData(stream(training, train.seed, train.grad_accum), eval_stream)
