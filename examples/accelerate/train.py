"""An accelerate training loop as its users write it, with hpc_train's checkpoints (plain accelerate: --plain).

    torchrun --nproc_per_node=2 train.py --plain                  # accelerate alone
    python -m hpc_train.submit examples/accelerate/job.toml --site local

A small MLP classifier on synthetic data in the user's own loop around an ``Accelerator``. Checkpoints are
``accelerator.save_state`` folders, every ``--save-every`` steps; a started run resumes from the newest with
``load_state`` and skips the batches of the epoch it had trained (``skip_first_batches``). With hpc_train's
``Checkpoints`` the same happens through one object, which also saves at the step a preemption signal arrived
and tells the loop to end there, on every rank: no step is lost or trained twice.
"""

from __future__ import annotations

import argparse
import gc
import re
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def dataset(samples: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(samples, 16, generator=generator)
    labels = (features[:, :4].sum(dim=1) > 0).long() + 2 * (features[:, 4:8].sum(dim=1) > 0).long()
    return TensorDataset(features, labels)


class PlainCheckpoints:
    """What an accelerate user writes without hpc_train: save_state every few steps, load the newest."""

    def __init__(self, accelerator: Accelerator, folder: str, every: int) -> None:
        self.accelerator, self.folder, self.every = accelerator, Path(folder), every

    def resume(self) -> int:
        steps = sorted(int(m[1]) for p in self.folder.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name)))
        if not steps:
            return 0
        self.accelerator.load_state(str(self.folder / f"step-{steps[-1]}"))
        return steps[-1]

    def step_end(self, step: int, **_: object) -> bool:
        if step % self.every == 0:
            self.accelerator.save_state(output_dir=str(self.folder / f"step-{step}"))
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--checkpoints", default="accelerate-checkpoints")
    parser.add_argument("--out", default="")
    parser.add_argument("--step-log", default="", help="append 'STEP TIME' for each step trained (rank 0)")
    parser.add_argument("--plain", action="store_true", help="accelerate alone: leave hpc_train's checkpoints out")
    args = parser.parse_args()

    # A seedable sampler: each epoch's order depends on the seed and the epoch alone, so a resumed epoch
    # shuffles as the first run did (accelerate's own advice for reproducible resumption).
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset(), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.plain:
        checkpoints = PlainCheckpoints(accelerator, args.checkpoints, args.save_every)
    else:
        from hpc_train.integrations.accelerate import Checkpoints

        checkpoints = Checkpoints(accelerator, args.checkpoints, every=args.save_every)
    step = checkpoints.resume()
    stopped = False
    while step < args.steps and not stopped:
        epoch, done = divmod(step, len(loader))
        loader.set_epoch(epoch)
        for features, labels in accelerator.skip_first_batches(loader, done) if done else loader:
            loss = nn.functional.cross_entropy(model(features), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(args.step_sleep)  # a slower step, for trying preemption by hand
            step += 1
            if args.step_log and accelerator.is_main_process:  # each step trained, when (for measuring a restart)
                with open(args.step_log, "a", encoding="utf-8") as out:
                    out.write(f"{step} {time.time()}\n")
            if checkpoints.step_end(step, loss=loss.detach()) or step == args.steps:
                stopped = step < args.steps
                break
    if accelerator.is_main_process and args.out and step == args.steps:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.out)
        print(f"trained {step} steps; weights in {args.out}")


def leave_group() -> None:
    """End the way torch asks: every rank at a barrier, the DDP-wrapped model gone, then the group destroyed.
    A rank that exits while its peer's gloo threads still talk to it can end that peer in ``terminate called
    without an active exception`` (SIGABRT) after its last step."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()  # the prepared model (gone with main's frame) holds the group through its DDP wrapper
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_group()
