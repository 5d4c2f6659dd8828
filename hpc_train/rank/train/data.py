"""Token sources and a resumable data-parallel sampler.

Why this shape: every rank must see a disjoint slice of the same global batch, and a job that is preempted and
requeued (possibly on a different number of ranks) must continue with exactly the samples an uninterrupted run
would have used. So samples are addressed by index only (a source is a pure function of the index), the order is
a seeded permutation per epoch shared by all ranks, and the sampler's state is the global position
``(epoch, offset)``, identical on every rank and independent of the data-parallel size.

Token files are raw little-endian uint16, one token per element (``python -m hpc_train.login.prepare`` writes
them from text, byte-level, vocab 256). numpy is needed here; torch only in :func:`batch`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hpc_train.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    import torch

__all__ = [
    "SOURCES",
    "TOKEN_DTYPE",
    "ResumableSampler",
    "SyntheticTokens",
    "TokenFile",
    "TokenSource",
    "batch",
    "make_source",
]

# On-disk token format: little-endian uint16, whatever the machine's byte order.
TOKEN_DTYPE = np.dtype("<u2")
SOURCES = ("synthetic", "tokens")
# Tokens checked against vocab_size when a file is opened; the rest are checked as samples are read.
_PREFIX_CHECK = 1 << 20
_MASK64 = (1 << 64) - 1


def _seed_words(seed: int) -> int:
    """numpy seed sequences take non-negative integers; fold any Python int into 64 bits."""
    return seed & _MASK64


class TokenSource(Protocol):
    """Samples addressed by index: sample ``i`` is the same on every rank, in every run."""

    def num_samples(self, seq_len: int) -> int:
        """How many samples of ``seq_len + 1`` tokens the source holds."""
        ...

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """int64 array of ``seq_len + 1`` tokens: inputs are ``[:-1]``, targets ``[1:]``."""
        ...


class SyntheticTokens:
    """Seeded Markov-chain text: learnable (entropy far below log(vocab)), and no file to ship.

    Each token has four possible successors, drawn once from ``seed`` and taken with fixed skewed
    probabilities, so a model can push its loss from log(vocab_size) towards :attr:`entropy` nats per token.
    Sample ``i`` depends only on ``(seed, i)``.
    """

    # Successor probabilities: skewed so that the best achievable loss is about 0.9 nats.
    PROBS = (0.7, 0.15, 0.1, 0.05)

    def __init__(self, vocab_size: int, seed: int, num_samples: int = 1 << 16) -> None:
        if not 2 <= vocab_size <= 1 << 16:
            raise ConfigError("data.vocab_size", f"{vocab_size} is outside 2..65536 (synthetic data)")
        if num_samples < 1:
            raise ValueError(f"synthetic data: num_samples {num_samples} must be at least 1")
        self.vocab_size = vocab_size
        self.seed = seed
        self._num_samples = num_samples
        rng = np.random.default_rng([_seed_words(seed), 0])
        self._successors = rng.integers(0, vocab_size, size=(vocab_size, len(self.PROBS))).tolist()
        self._cumulative = np.cumsum(self.PROBS)

    @property
    def entropy(self) -> float:
        """Nats per token of an ideal model (upper bound: successors that coincide lower it)."""
        probs = np.asarray(self.PROBS)
        return float(-(probs * np.log(probs)).sum())

    def num_samples(self, seq_len: int) -> int:
        """The fixed sample count given at construction (any ``seq_len``)."""
        return self._num_samples

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Walk the chain for ``seq_len`` steps from a random first token, seeded by ``(seed, index)``."""
        if not 0 <= index < self._num_samples:
            raise IndexError(f"synthetic sample {index} is outside 0..{self._num_samples - 1}")
        rng = np.random.default_rng([_seed_words(self.seed), 1, index])
        first = int(rng.integers(0, self.vocab_size))
        branches = np.searchsorted(self._cumulative, rng.random(seq_len), side="right").tolist()
        tokens = [first]
        successors = self._successors
        for branch in branches:
            tokens.append(successors[tokens[-1]][min(branch, len(self.PROBS) - 1)])
        return np.asarray(tokens, dtype=np.int64)


class TokenFile:
    """A uint16 token file, memory-mapped; sample ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``.

    Windows overlap by one token only (the last target of one sample is the first input of the next), so an
    epoch reads the file once.
    """

    def __init__(self, path: str | os.PathLike[str], vocab_size: int) -> None:
        self.path = os.fspath(path)
        if not 1 <= vocab_size <= 1 << 16:
            raise ConfigError("data.vocab_size", f"{vocab_size} is outside 1..65536", "uint16 tokens need <= 65536")
        self.vocab_size = vocab_size
        self._tokens = self._open()
        self._check(0, min(len(self._tokens), _PREFIX_CHECK))

    def _open(self) -> np.memmap:
        """Map the file after checking that it exists and holds whole uint16 tokens."""
        fix = f"write it with: python -m hpc_train.login.prepare TEXT_FILE {self.path}"
        if not os.path.isfile(self.path):
            raise ConfigError(self.path, "no such token file", fix + ", or set data.path to an existing file")
        size = os.path.getsize(self.path)
        if size == 0:
            raise ConfigError(self.path, "token file is empty", fix)
        if size % TOKEN_DTYPE.itemsize:
            raise ConfigError(self.path, f"size {size} bytes is odd, not whole uint16 tokens (truncated?)", fix)
        return np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")

    def _check(self, start: int, stop: int) -> None:
        """Refuse tokens ``>= vocab_size`` in ``[start, stop)``: they would index past the embedding."""
        window = self._tokens[start:stop]
        if len(window) and int(window.max()) >= self.vocab_size:
            at = start + int(np.argmax(window >= self.vocab_size))
            raise ConfigError(self.path, f"token {int(self._tokens[at])} at position {at} is not below "
                              f"vocab_size {self.vocab_size}",
                              "set data.vocab_size to the tokenizer's vocabulary (256 for prepare's byte-level "
                              "files), or re-prepare the file")

    def __len__(self) -> int:
        return len(self._tokens)

    def __getstate__(self) -> dict[str, Any]:
        """DataLoader workers get the path and map the file themselves (a pickled memmap would copy it all)."""
        return {key: value for key, value in self.__dict__.items() if key != "_tokens"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tokens = self._open()

    def num_samples(self, seq_len: int) -> int:
        """Non-overlapping windows of ``seq_len`` inputs; the file must hold at least one."""
        if seq_len < 1:
            raise ValueError(f"seq_len {seq_len} must be at least 1")
        count = (len(self._tokens) - 1) // seq_len
        if count < 1:
            raise ConfigError(self.path, f"holds {len(self._tokens)} tokens, fewer than seq_len + 1 = "
                              f"{seq_len + 1} needed for one sample",
                              "prepare a larger text, or lower train.seq_len")
        return count

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens of window ``index`` as int64, checked against ``vocab_size``."""
        count = self.num_samples(seq_len)
        if not 0 <= index < count:
            raise IndexError(f"{self.path}: sample {index} is outside 0..{count - 1} at seq_len {seq_len}")
        start = index * seq_len
        if start + seq_len + 1 > _PREFIX_CHECK:
            self._check(start, start + seq_len + 1)
        return np.asarray(self._tokens[start:start + seq_len + 1], dtype=np.int64)


def make_source(source: str, path: str, vocab_size: int, seed: int) -> TokenSource:
    """The ``[data]`` section's source: ``synthetic`` (seeded) or ``tokens`` (the file at ``path``)."""
    if source == "synthetic":
        return SyntheticTokens(vocab_size, seed)
    if source == "tokens":
        if not path:
            raise ConfigError("data.path", "is empty but data.source is tokens",
                              "set data.path to a token file from python -m hpc_train.login.prepare")
        return TokenFile(path, vocab_size)
    raise ConfigError("data.source", f'unknown source "{source}"',
                      did_you_mean(source, SOURCES) or f"use one of: {', '.join(SOURCES)}")


class ResumableSampler:
    """This data-parallel rank's micro-batches of sample indices, resumable at any optimizer step's boundary.

    Each epoch is a permutation seeded by ``(seed, epoch)``, the same on every rank. An optimizer step takes the
    next ``micro_batch * dp_size * grad_accum`` consecutive positions (the global batch), ``grad_accum``
    micro-steps of ``micro_batch * dp_size`` positions each, of which rank ``r`` takes ``[r * micro_batch,
    (r + 1) * micro_batch)``. An epoch ends where less than a global batch is left (the rest is dropped), so every
    layout with the same global batch (another data-parallel size with the accumulation that keeps it, as
    ``retry.shrink`` runs) gives each step the same samples, across epochs too.
    """

    def __init__(self, num_samples: int, dp_rank: int, dp_size: int, micro_batch: int, seed: int,
                 shuffle: bool = True, grad_accum: int = 1) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"sampler: dp_rank {dp_rank} is outside 0..{dp_size - 1} (dp_size {dp_size})")
        if micro_batch < 1 or grad_accum < 1:
            raise ValueError(f"sampler: micro_batch {micro_batch} and grad_accum {grad_accum} must be at least 1")
        self.num_samples, self.dp_rank, self.dp_size = num_samples, dp_rank, dp_size
        self.micro_batch, self.seed, self.shuffle, self.grad_accum = micro_batch, seed, shuffle, grad_accum
        self.micro_step_batch = micro_batch * dp_size
        self.global_batch = self.micro_step_batch * grad_accum
        if num_samples < self.global_batch:
            accum = f" x grad_accum {grad_accum}" if grad_accum > 1 else ""
            raise ValueError(f"sampler: {num_samples} samples are fewer than one global batch of "
                             f"{self.global_batch} = micro_batch {micro_batch} x dp_size {dp_size}{accum}; "
                             "use more data, a shorter seq_len or a smaller batch")
        self.epoch = 0
        self.offset = 0
        self._micro_step = 0  # micro-batches taken of the current optimizer step
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Global batches (optimizer steps) in one epoch."""
        return self.num_samples // self.global_batch

    def _permutation(self) -> np.ndarray:
        """The current epoch's sample order, cached."""
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                rng = np.random.default_rng([_seed_words(self.seed), 2, self.epoch])
                order = rng.permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._order = (self.epoch, order)
        return self._order[1]

    def _roll_over(self) -> None:
        """At a step's boundary, start the next epoch when the rest of this one is less than a global batch."""
        if self._micro_step == 0 and self.offset + self.global_batch > self.num_samples:
            self.epoch += 1
            self.offset = 0

    def next_indices(self) -> list[int]:
        """Sample indices of this rank's next micro-batch; advances the global position by one micro-step."""
        self._roll_over()
        start = self.offset + self.dp_rank * self.micro_batch
        indices = self._permutation()[start:start + self.micro_batch].tolist()
        self.offset += self.micro_step_batch
        self._micro_step = (self._micro_step + 1) % self.grad_accum
        self._roll_over()
        return indices

    def state_dict(self) -> dict[str, int]:
        """The global position, the same on every data-parallel rank: save it from any one of them (at a step's
        boundary, where checkpoints are taken)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved global position, also at a different ``dp_size`` whose micro-step fits it."""
        try:
            epoch, offset = int(state["epoch"]), int(state["offset"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"sampler state {state!r} needs integer 'epoch' and 'offset'") from None
        if epoch < 0 or not 0 <= offset <= self.num_samples:
            raise ValueError(f"sampler state epoch {epoch}, offset {offset} is outside this data set of "
                             f"{self.num_samples} samples (did the data or seq_len change since the checkpoint?)")
        if offset % self.micro_step_batch:
            raise ValueError(f"sampler state: offset {offset} samples into epoch {epoch} is not a multiple of "
                             f"micro_batch {self.micro_batch} x dp_size {self.dp_size} = {self.micro_step_batch}; "
                             f"resume with a micro_batch x dp_size that divides {offset}")
        self.epoch, self.offset, self._micro_step = epoch, offset, 0
        self._roll_over()


def batch(source: TokenSource, indices: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, int64 CPU tensors of shape ``[len(indices), seq_len]`` (targets shifted by one)."""
    import torch

    if not indices:
        raise ValueError("batch: no sample indices")
    rows = [source.sample(index, seq_len) for index in indices]
    for index, row in zip(indices, rows, strict=True):
        if row.shape != (seq_len + 1,):
            raise ValueError(f"batch: sample {index} has shape {row.shape}, expected ({seq_len + 1},)")
    tokens = torch.from_numpy(np.stack(rows).astype(np.int64, copy=False))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
