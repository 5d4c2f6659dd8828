"""A token dataset that sleeps in every ``__getitem__`` (a slow disk, a costly decode): the step-time breakdown
shows the data wait, and DataLoader workers hide it."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

SLEEP_S = 0.004


class SlowTokens(Dataset):
    def __init__(self, count: int, seq_len: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (count, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SLEEP_S)
        row = self.tokens[index]
        return row[:-1], row[1:]


def dataset(ctx, split):
    config = ctx.config
    return SlowTokens(2048 if split == "train" else 64, config.train.seq_len, config.data.vocab_size,
                      seed=0 if split == "train" else 1)
