"""A small language model built from hpc_train's tensor-parallel layers (the trainer's own synthetic tokens
come as ``(inputs, targets)``), as docs/your-own-code.md shows: it runs unchanged at any tensor size."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from hpc_train.rank.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from hpc_train.rank.train.pipeline_layers import pipeline_layers


class ParallelMLP(nn.Module):
    """Column-parallel up, row-parallel down: one all-reduce forward and one backward per block."""

    def __init__(self, hidden: int, group, seed: int) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(hidden, 4 * hidden, group, seed=seed)
        self.down = RowParallelLinear(4 * hidden, hidden, group, seed=seed + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(functional.gelu(self.up(x)))


class MLPLanguageModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, group) -> None:
        super().__init__()
        self.group = group
        self.embed = VocabParallelEmbedding(vocab, hidden, group, seed=1)
        self.blocks = nn.ModuleList(ParallelMLP(hidden, group, seed=10 * (i + 1)) for i in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = ColumnParallelLinear(hidden, vocab, group, bias=False, seed=2)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(self.norm(x))
        return vocab_parallel_cross_entropy(logits, targets, self.group).mean()


def model(ctx):
    return MLPLanguageModel(ctx.config.data.vocab_size, ctx.params.get("hidden", 32), 2, ctx.group("tp"))


class Residual(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class NormHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, group) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.head = ColumnParallelLinear(hidden, vocab, group, bias=False, seed=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def pipeline_model(ctx):
    """The same model (the same seeds, so the same weights) as layers, to run with parallel.pipeline > 1."""
    vocab, hidden, group = ctx.config.data.vocab_size, ctx.params.get("hidden", 32), ctx.group("tp")
    layers = [VocabParallelEmbedding(vocab, hidden, group, seed=1)]
    layers += [Residual(ParallelMLP(hidden, group, seed=10 * (i + 1))) for i in range(2)]
    layers.append(NormHead(hidden, vocab, group))
    return pipeline_layers(layers, lambda logits, targets: vocab_parallel_cross_entropy(logits, targets,
                                                                                         group).mean())
