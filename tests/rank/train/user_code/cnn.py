"""A small CNN classifier on a tensor dataset: 8x8 single-channel noise images whose class is the quadrant that
is brighter, made from a seed (item ``i`` is the same on every rank and in every run)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional


class Quadrants(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (count,), generator=generator)
        self.images = torch.rand(count, 1, 8, 8, generator=generator) * 0.5
        for image, label in zip(self.images, self.labels.tolist(), strict=True):
            row, column = divmod(label, 2)
            image[:, 4 * row:4 * row + 4, 4 * column:4 * column + 4] += 0.5

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class SmallCNN(nn.Module):
    """With a batch norm: its running statistics are buffers, one of them an integer, which export keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = functional.max_pool2d(functional.relu(self.norm(self.conv(images))), 2)
        return functional.cross_entropy(self.head(x.flatten(1)), labels)


def as_dict(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``data.collate``: the batch as keywords of the forward."""
    return {"images": torch.stack([image for image, _ in samples]),
            "labels": torch.stack([label for _, label in samples])}


def model(ctx):
    return SmallCNN()


def dataset(ctx, split):
    return Quadrants(512 if split == "train" else 64, seed=0 if split == "train" else 1)
