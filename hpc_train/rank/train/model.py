"""A decoder-only GPT whose attention, MLP, embedding and head are tensor-parallel.

With a tensor group of size N every rank holds 1/N of the heads, of the MLP and of the vocabulary, and the
model computes exactly what the unsharded model does (the layers draw their full weights from fixed seeds and
keep their shard). The fused query/key/value weight is laid out head by head, ``[q_h, k_h, v_h]`` for each
head ``h``, so a contiguous shard holds whole heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from hpc_train.config.job import MODEL_PRESETS
from hpc_train.rank.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_world_size,
    vocab_parallel_cross_entropy,
)
from hpc_train.rank.distributed.tp_init import fill_parameter

__all__ = ["GPT", "GPTConfig", "count_parameters", "make_embeddings"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int
    seq_len: int
    layers: int
    heads: int
    hidden: int

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, seq_len: int) -> GPTConfig:
        preset = MODEL_PRESETS[name]
        return cls(vocab_size, seq_len, preset["layers"], preset["heads"], preset["hidden"])


def _mark_sharded(module: nn.Module, *names: str) -> None:
    """Tell DeepSpeed these parameters differ across the tensor group (gradient norms count each shard once)."""
    for name in names:
        param = getattr(module, name, None)
        if param is not None:
            param.model_parallel = True
            param.tensor_model_parallel = True


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, group: Any, seed: int) -> None:
        super().__init__()
        tp = tp_world_size(group)
        self.heads = config.heads // tp
        self.head_dim = config.hidden // config.heads
        self.qkv = ColumnParallelLinear(config.hidden, 3 * config.hidden, group, seed=seed)
        self.proj = RowParallelLinear(config.hidden, config.hidden, group, seed=seed + 1)
        _mark_sharded(self.qkv, "weight", "bias")
        _mark_sharded(self.proj, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv(x).view(batch, length, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, group: Any, seed: int) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(config.hidden, 4 * config.hidden, group, seed=seed)
        self.proj = RowParallelLinear(4 * config.hidden, config.hidden, group, seed=seed + 1)
        _mark_sharded(self.fc, "weight", "bias")
        _mark_sharded(self.proj, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(functional.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, group: Any, seed: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = Attention(config, group, seed)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config, group, seed + 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def make_embeddings(config: GPTConfig, group: Any, seed: int) -> tuple[VocabParallelEmbedding, nn.Embedding]:
    """The token embedding (vocabulary-parallel) and the position embedding (replicated), seeded: shared by
    :class:`GPT` and the first pipeline stage so both start from the same weights."""
    token = VocabParallelEmbedding(config.vocab_size, config.hidden, group, seed=seed)
    _mark_sharded(token, "weight")
    position = nn.Embedding(config.seq_len, config.hidden)
    if not position.weight.is_meta:  # FSDP2's meta build draws it in GPT.init_weights
        with torch.no_grad():
            position.weight.copy_(_position_table(config, seed))
    return token, position


def _position_table(config: GPTConfig, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.empty(config.seq_len, config.hidden).normal_(0.0, 0.02, generator=generator)


class GPT(nn.Module):
    """``forward(tokens, targets)`` returns the mean next-token loss over the batch."""

    def __init__(self, config: GPTConfig, group: Any = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.group = group
        self.seed = seed
        self.wte, self.wpe = make_embeddings(config, group, seed)
        self.blocks = nn.ModuleList(Block(config, group, seed + 100 * (i + 1)) for i in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = ColumnParallelLinear(config.hidden, config.vocab_size, group, bias=False, seed=seed + 2)
        _mark_sharded(self.head, "weight")

    def init_weights(self) -> None:
        """Draw every weight again, the same numbers as the constructor draws, into parameters FSDP2 has sharded:
        a model built on the meta device and materialised with ``to_empty`` (:mod:`hpc_train.rank.train.engine_fsdp2`)
        starts where a whole build starts. Each rank draws a whole parameter at a time, never the whole model."""
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding | nn.LayerNorm):
                module.reset_parameters()
        fill_parameter(self.wpe.weight, _position_table(self.config, self.seed))

    def fsdp_blocks(self) -> list[nn.Module]:
        """What FSDP2 shards one by one before the root (which keeps the embeddings, the final norm and the head):
        the transformer blocks."""
        return list(self.blocks)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return vocab_parallel_cross_entropy(logits.float(), targets, self.group).mean()


def count_parameters(config: GPTConfig) -> int:
    """Parameters of the unsharded model (for FLOPs and memory plans), computed without building it."""
    h, layers = config.hidden, config.layers
    per_block = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
    return config.vocab_size * h + config.seq_len * h + layers * per_block + 2 * h + config.vocab_size * h
