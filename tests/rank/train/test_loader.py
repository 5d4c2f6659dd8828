"""The batch stream: any map-style dataset through a DataLoader, whose saved position is that of the batches
the trainer took (not of those the workers loaded ahead), so a resume continues exactly, with workers too."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_train.rank.runtime.entry_points import UserCodeError
from hpc_train.rank.train.data import ResumableSampler, TokenFile
from hpc_train.rank.train.loader import BatchStream, LoaderSettings, TokenDataset, checked_dataset, to_device


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        yield from range(100)


class Items(torch.utils.data.Dataset):
    """Item i is a dict holding i: what a batch holds says which samples it came from."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), "value": torch.full((2,), float(index))}


def _stream(workers: int, dp_rank: int = 0, dp_size: int = 1, micro: int = 4) -> BatchStream:
    settings = LoaderSettings(num_workers=workers, prefetch_factor=4 if workers else 0,
                              persistent_workers=bool(workers))
    return BatchStream(Items(), ResumableSampler(40, dp_rank, dp_size, micro, seed=3), settings,
                       torch.device("cpu"), seed=3)


def _indices(stream: BatchStream, count: int) -> list[list[int]]:
    return [next(stream)["index"].tolist() for _ in range(count)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_stream_continues_with_the_next_batch_the_trainer_did_not_take(workers: int) -> None:
    uninterrupted = _indices(_stream(0), 25)  # across epochs: 10 batches per epoch
    first = _stream(workers)
    taken = _indices(first, 7)  # workers have loaded ahead; the position counts what was taken
    state = first.state_dict()
    assert state == {"epoch": 0, "offset": 28}
    resumed = _stream(workers)
    resumed.load_state_dict(state)
    assert taken + _indices(resumed, 18) == uninterrupted


def test_the_position_carries_over_to_another_data_parallel_size() -> None:
    """2 data-parallel ranks of micro batch 2 take together what 1 rank of micro batch 4 takes."""
    one = _stream(0)
    _indices(one, 3)
    two = [_stream(0, rank, 2, micro=2) for rank in range(2)]
    for stream in two:
        stream.load_state_dict(one.state_dict())
    expected = _indices(one, 4)
    together = [a + b for a, b in zip(_indices(two[0], 4), _indices(two[1], 4), strict=True)]
    assert together == expected


def test_tensors_in_nested_batches_move_and_the_rest_stays() -> None:
    batch = {"x": torch.zeros(1), "pair": (torch.ones(1), "name"), "list": [torch.zeros(2)], "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["pair"][1] == "name" and moved["n"] == 3 and isinstance(moved["pair"], tuple)


@pytest.mark.parametrize(("dataset", "says"), [
    (torch.utils.data.TensorDataset(torch.zeros(0, 1)), "returned a dataset of 0 samples, fewer than one global "
     "batch of 8"),
    (torch.utils.data.TensorDataset(torch.zeros(5, 1)), "of 5 samples, fewer than one global batch of 8"),
    (Stream(), "not a map-style dataset"),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], None),
])
def test_a_dataset_shorter_than_a_global_batch_or_not_map_style_is_named(dataset: object, says: str | None) -> None:
    said = 'data.source d.py:data: dataset(ctx, "train")'
    if says is None:
        assert checked_dataset(dataset, said, 8) is dataset
        return
    with pytest.raises(UserCodeError) as error:
        checked_dataset(dataset, said, 8)
    assert str(error.value).startswith(said) and says in str(error.value)


def test_a_token_file_reaches_workers_as_its_path_not_its_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens.u16"
    np.arange(5000, dtype="<u2").__mod__(256).astype("<u2").tofile(path)
    source = TokenFile(path, 256)
    pickled = pickle.dumps(TokenDataset(source, 16))
    assert len(pickled) < 2000  # 10 kB of tokens are not in it
    inputs, targets = pickle.loads(pickled)[3]  # noqa: S301 (our own bytes, just written)
    assert inputs.tolist() == list(range(48, 64)) and targets.tolist() == list(range(49, 65))
