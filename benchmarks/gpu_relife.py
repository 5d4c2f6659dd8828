"""A warm restart's CUDA side, in one process: a DeepSpeed ZeRO-2 life on the device, its end as a failed life's
(:func:`hpc_train.rank.train.relife.end_life` and :func:`release_life`: the process group aborted on NCCL, the
engine destroyed, DeepSpeed's groups forgotten, the cache emptied), then a second life in the same process.

    python benchmarks/gpu_relife.py [--device cuda|cpu]

Prints one JSON line: whether the second life trained to the first's losses bit for bit, whether the first
engine was freed, the device memory allocated before the first life, after its release and after the second,
whether the CUDA context stayed (no second initialisation), how long each life took to build, and whether the
asynchronous save's staging into pinned host buffers (the memory tier's and the disk's) was pinned and let go of.
``scripts/gpu_check.sh`` runs it as its ``relife`` step (on CPUs, gloo and no pinning, in its dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.bench.local_ranks import free_port


def _life(device: torch.device, port: int) -> tuple[list[float], Any, float]:
    import deepspeed

    from hpc_train.rank.train.dscomm import init_deepspeed_comm

    started = time.perf_counter()
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    init_deepspeed_comm(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1)).to(device)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    built = time.perf_counter() - started
    inputs = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        loss = engine(torch.randn(8, 256, generator=inputs).to(device)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine, built


def _staged_save(engine: Any, folder: Path) -> dict[str, Any]:
    """The asynchronous save's staging of the engine's module state: pinned host buffers on a GPU, an event the
    writer waits for; then the writer thread ended and the buffers let go of (RankFiles.close)."""
    from hpc_train.checkpoint.rank_files import RankFiles

    files = RankFiles(0, async_save=True)
    files.begin(folder, staged=True)
    files.save(engine.module.state_dict(), folder / "module.pt")
    pinned = all(buffer.is_pinned() for buffers in files._buffers.values() for buffer in buffers)
    files.announce()  # the staged files go to the writer thread (with the marker: a folder of its own)
    files.drain()
    thread = files._thread
    files.close()
    if thread is not None:
        thread.join(timeout=30)
    return {"pinned": pinned, "written": [entry.path for entry in files.entries],
            "writer_thread_ended": thread is None or not thread.is_alive(), "buffers_left": len(files._buffers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from hpc_train.rank.train.relife import end_life, release_life

    memory = (lambda: torch.cuda.memory_allocated(device)) if device.type == "cuda" else (lambda: 0)
    before = memory()
    first, engine, built_first = _life(device, free_port())
    with tempfile.TemporaryDirectory() as folder:
        staging = _staged_save(engine, Path(folder))
    old = weakref.ref(engine)
    end_life(engine)
    del engine
    release_life()
    released = memory()
    context = torch.cuda.is_initialized() if device.type == "cuda" else None
    second, engine, built_second = _life(device, free_port())
    print(json.dumps({
        "device": str(device), "bitwise_equal": second == first, "losses": first,
        "first_engine_freed": old() is None, "memory_allocated": {"before": before, "after_release": released,
                                                                  "second_life": memory()},
        "cuda_context_kept": context, "build_seconds": {"first": round(built_first, 3),
                                                        "second": round(built_second, 3)},
        "staging": staging}))
    end_life(engine)


if __name__ == "__main__":
    main()
