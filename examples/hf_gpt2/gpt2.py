"""A Hugging Face GPT-2, built from a small config (nothing is downloaded), trained on a byte-level token file.

    python -m hpc_train.login.prepare examples/corpus/hpc_train_docs.txt corpus.u16
    python -m hpc_train.submit examples/hf_gpt2/job.toml --site local

``model(ctx)`` is the factory of ``[train] model``, ``dataset(ctx, split)`` the dataset of ``[data] source``;
each batch is a dict, so the trainer calls ``model(input_ids=..., labels=...)`` and takes ``output.loss``.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def model(ctx):
    """GPT-2 with the shape in ``[params]`` and the job's sequence length, no dropout by default."""
    p = ctx.params
    config = GPT2Config(vocab_size=p.get("vocab_size", 256), n_positions=ctx.config.train.seq_len,
                        n_embd=p.get("hidden", 64), n_layer=p.get("layers", 2), n_head=p.get("heads", 4),
                        resid_pdrop=p.get("dropout", 0.0), embd_pdrop=p.get("dropout", 0.0),
                        attn_pdrop=p.get("dropout", 0.0), bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class TokenWindows(torch.utils.data.Dataset):
    """Window ``i`` of ``seq_len`` tokens of a uint16 token file, as GPT-2 takes it (it shifts the labels)."""

    def __init__(self, path: str, seq_len: int, first: int, count: int) -> None:
        self.path, self.seq_len, self.first, self.count = path, seq_len, first, count
        self._tokens = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._tokens is None:  # mapped in the process that reads (a DataLoader worker maps its own)
            self._tokens = np.memmap(self.path, dtype="<u2", mode="r")
        start = (self.first + index) * self.seq_len
        window = torch.from_numpy(self._tokens[start:start + self.seq_len].astype(np.int64))
        return {"input_ids": window, "labels": window}


def dataset(ctx, split):
    """The token file of ``data.path``: the last tenth of its windows for evaluation, the rest for training."""
    path, seq_len = ctx.config.data.path, ctx.config.train.seq_len
    windows = len(np.memmap(path, dtype="<u2", mode="r")) // seq_len
    held_out = max(1, windows // 10)
    if split == "eval":
        return TokenWindows(path, seq_len, windows - held_out, held_out)
    return TokenWindows(path, seq_len, 0, windows - held_out)
