"""A plain torchrun-style DDP script: nothing in it knows hpc_train.

    torchrun --nproc_per_node=2 train_cnn.py --epochs 2
    python -m hpc_train.submit examples/ddp_script/job.toml --site local

A small CNN on a synthetic image dataset (the same on every run), a DistributedSampler with set_epoch,
rank 0 prints and, with --out, saves the final weights.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset(samples: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 1, 16, 16, generator=generator)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long() + 2 * (images[:, :, :8].mean(dim=(1, 2, 3)) > 0).long()
    return TensorDataset(images, labels)


def model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// from the torchrun variables
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = DistributedDataParallel(model())
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for images, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch}: mean loss {total / len(loader):.4f}", flush=True)
    if rank == 0 and args.out:
        torch.save(net.module.state_dict(), args.out)
    # End the way torch asks: the DDP wrapper gone, every rank at a barrier, then the group destroyed. A rank that
    # leaves while its peer's gloo threads still talk to it can end that peer in "terminate called without an
    # active exception" (SIGABRT) after its last step.
    del net, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
