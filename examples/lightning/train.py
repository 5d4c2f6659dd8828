"""A PyTorch Lightning script as its users write it, with hpc_train's callback (left out with --plain).

    torchrun --nproc_per_node=2 train.py --plain                  # Lightning alone
    python -m hpc_train.submit examples/lightning/job.toml --site local

A small MLP classifier on synthetic data, ``ModelCheckpoint`` every ``--save-every`` steps with ``save_last``,
and ``fit(..., ckpt_path="last")``, so a requeued run resumes from its own last checkpoint. The train loader is
torchdata's ``StatefulDataLoader`` over its ``StatefulDistributedSampler`` (``use_distributed_sampler=False``),
which Lightning saves in every checkpoint: a checkpoint in the middle of an epoch resumes at the next batch, not
at the epoch's start (with Lightning 2.6's own sampler in its place, a mid-epoch resume on 2 ranks drew another
order). With the callback, a preemption saves ``last.ckpt`` at
the step the signal arrived and ``fit`` returns on every rank: no step is lost or trained twice.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


def dataset(samples: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(samples, 16, generator=generator)
    labels = (features[:, :4].sum(dim=1) > 0).long() + 2 * (features[:, 4:8].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float, step_sleep: float, step_log: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.lr, self.step_sleep, self.step_log = lr, step_sleep, step_log

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, labels = batch
        loss = nn.functional.cross_entropy(self.net(features), labels)
        self.log("train_loss", loss)
        time.sleep(self.step_sleep)  # a slower step, for trying preemption by hand
        if self.step_log and self.trainer.is_global_zero:  # each step trained, when (for measuring a restart)
            with open(self.step_log, "a", encoding="utf-8") as out:
                out.write(f"{self.trainer.global_step + 1} {time.time()}\n")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--checkpoints", default="checkpoints")
    parser.add_argument("--out", default="")
    parser.add_argument("--step-log", default="", help="append 'STEP TIME' for each step trained (rank 0)")
    parser.add_argument("--plain", action="store_true", help="Lightning alone: leave hpc_train's callback out")
    args = parser.parse_args()

    pl.seed_everything(0, workers=True)
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=args.save_every,
                                                    save_last=True)]
    if not args.plain:
        from hpc_train.integrations.lightning import HpcTrainCallback

        callbacks.append(HpcTrainCallback())
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=local, num_nodes=world // local,
                         strategy="ddp" if world > 1 else "auto", callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         use_distributed_sampler=False)
    model = Classifier(args.lr, args.step_sleep, args.step_log)
    data = dataset()
    sampler = StatefulDistributedSampler(data, num_replicas=world, rank=int(os.environ.get("RANK", "0")), seed=0)
    loader = StatefulDataLoader(data, batch_size=16, sampler=sampler)
    trainer.fit(model, loader, ckpt_path="last")
    if trainer.global_rank == 0 and args.out and trainer.global_step == args.steps:
        torch.save(model.state_dict(), args.out)
        print(f"trained {trainer.global_step} steps; weights in {args.out}")


def leave_group() -> None:
    """End the way torch asks: every rank at a barrier, the Trainer's DDP wrapper gone, then the group destroyed.
    A rank that exits while its peer's gloo threads still talk to it can end that peer in ``terminate called
    without an active exception`` (SIGABRT) after its last step."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()  # the Trainer (gone with main's frame) holds the group through its DDP wrapper
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_group()
