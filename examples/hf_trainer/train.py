"""A Hugging Face ``Trainer`` script as its users write it, with hpc_train's callback (left out with --plain).

    torchrun --nproc_per_node=2 train.py --plain                  # transformers alone
    python -m hpc_train.submit examples/hf_trainer/job.toml --site local

A small MLP classifier (any ``nn.Module`` whose forward returns the loss) on synthetic data, a checkpoint every
``--save-every`` steps, and ``train(resume_from_checkpoint=get_last_checkpoint(output_dir))``, so a requeued run
resumes from its own newest ``checkpoint-N`` (model, optimizer, scheduler, RNG states, its place in the epoch).
With the callback, a preemption makes the Trainer save at the step the signal arrived and ``train`` returns on
every rank: no step is lost or trained twice.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Synthetic(Dataset):
    def __init__(self, samples: int = 512) -> None:
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(samples, 16, generator=generator)
        self.labels = (self.features[:, :4].sum(dim=1) > 0).long() + 2 * (self.features[:, 4:8].sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[index], "labels": self.labels[index]}


class Classifier(nn.Module):
    def __init__(self, step_sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.step_sleep = step_sleep

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(features)
        if self.training:
            time.sleep(self.step_sleep)  # a slower step, for trying preemption by hand
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class StepLog(TrainerCallback):
    """Each step trained and when (rank 0), for measuring a restart."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kwargs: object) -> None:
        if getattr(state, "is_world_process_zero", False):
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(f"{getattr(state, 'global_step', 0)} {time.time()}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--output-dir", default="hf-output")
    parser.add_argument("--out", default="")
    parser.add_argument("--step-log", default="", help="append 'STEP TIME' for each step trained (rank 0)")
    parser.add_argument("--plain", action="store_true", help="transformers alone: leave hpc_train's callback out")
    args = parser.parse_args()

    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=16,
                                 learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                                 save_steps=args.save_every, save_total_limit=2, logging_steps=1, report_to=[],
                                 use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
                                 ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    callbacks: list[TrainerCallback] = [StepLog(args.step_log)] if args.step_log else []
    if not args.plain:
        from hpc_train.integrations.transformers import HpcTrainCallback

        callbacks.append(HpcTrainCallback())
    torch.manual_seed(0)
    trainer = Trainer(model=Classifier(args.step_sleep), args=training, train_dataset=Synthetic(), callbacks=callbacks)
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero() and args.out and trainer.state.global_step == args.steps:
        torch.save(trainer.model.state_dict(), args.out)
        print(f"trained {trainer.state.global_step} steps; weights in {args.out}")


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
