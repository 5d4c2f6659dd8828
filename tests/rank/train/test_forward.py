"""The forward contract of ``[train] model``: how a batch is passed, where the loss is found, and the one line
that says what a forward returned instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hpc_train.rank.runtime.entry_points import UserCodeError
from hpc_train.rank.train.forward import forward_loss, loss_of


def _model(*args: object, **kwargs: object) -> dict[str, object]:
    return {"loss": torch.tensor(float(len(args) + 10 * len(kwargs)))}


@pytest.mark.parametrize(("batch", "expected"), [
    ({"input_ids": 1, "labels": 2}, 20.0), ((1, 2, 3), 3.0), ([1, 2], 2.0), (torch.zeros(2), 1.0)])
def test_a_dict_is_passed_as_keywords_a_tuple_or_list_as_arguments_anything_else_as_one(batch: object,
                                                                                          expected: float) -> None:
    assert float(forward_loss(_model, batch, "m")) == expected


@pytest.mark.parametrize("output", [torch.tensor(1.5), torch.tensor([1.5]), {"loss": torch.tensor(1.5)},
                                    SimpleNamespace(loss=torch.tensor(1.5), logits=None)])
def test_the_loss_is_a_scalar_tensor_or_held_as_loss(output: object) -> None:
    loss = loss_of(output, "m")
    assert loss.shape == () and float(loss) == 1.5


@pytest.mark.parametrize(("output", "says"), [
    (torch.zeros(4, 8), "train.model m.py:model: the forward's loss is (4, 8), not a scalar tensor; reduce it"),
    ({"logits": torch.zeros(1)}, "the forward returned dict with no loss; return the loss, or an object or dict"),
    (SimpleNamespace(loss=None), "the forward returned SimpleNamespace with no loss"),
    ({"loss": 1.0}, "the forward's loss is float, not a scalar tensor"),
])
def test_a_forward_without_a_usable_loss_is_named(output: object, says: str) -> None:
    with pytest.raises(UserCodeError, match=None) as error:
        loss_of(output, "train.model m.py:model")
    assert says in str(error.value)
