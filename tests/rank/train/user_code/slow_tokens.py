"""A token dataset that sleeps in every ``__getitem__`` (a slow disk, a costly decode): the step-time breakdown
shows the data wait, and DataLoader workers hide it. ``[params] sleep_s`` sets the sleep (4 ms by default)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

SLEEP_S = 0.004


class SlowTokens(Dataset):
    def __init__(self, count: int, seq_len: int, vocab: int, seed: int, sleep_s: float = SLEEP_S) -> None:
        self.sleep_s = sleep_s
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (count, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sleep_s)
        row = self.tokens[index]
        return row[:-1], row[1:]


def dataset(ctx, split):
    config = ctx.config
    return SlowTokens(2048 if split == "train" else 64, config.train.seq_len, config.data.vocab_size,
                      seed=0 if split == "train" else 1, sleep_s=float(ctx.params.get("sleep_s", SLEEP_S)))
