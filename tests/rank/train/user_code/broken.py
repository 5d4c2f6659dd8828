"""Factories and datasets that go wrong, each in one way a user's can."""

from __future__ import annotations

import torch


class Logits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 4)  # 32: the tests' seq_len

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs.float())  # logits, no loss


def raises(ctx):
    raise ValueError("no weights for layer 3")


def not_a_module(ctx):
    return [torch.nn.Linear(4, 4)]


def no_loss(ctx):
    return Logits()


def empty(ctx, split):
    return torch.utils.data.TensorDataset(torch.zeros(0, 4))


def short(ctx, split):
    return torch.utils.data.TensorDataset(torch.zeros(3, 4))


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(100)


def stream(ctx, split):
    return Stream()
