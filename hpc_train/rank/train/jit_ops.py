"""DeepSpeed's just-in-time compiled ops, built once per node and never waited on forever.

DeepSpeed compiles some ops on first use (``cpu_adam``, ``fused_adam``) under
torch's extension folder, guarded by a ``lock`` file that the builder deletes when it is done. A rank killed
while compiling (preempted, timed out, Ctrl-C) leaves that file behind, and from then on every job of that user
waits for it without end and without a word. Here the ops a job's optimizer needs are built before
``deepspeed.initialize`` by one rank per node while the others wait at a barrier, and a lock older than any
build is removed with a warning. ``python -m hpc_train.rank.train.jit_ops cpu_adam`` does the same from a shell.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OPTIMIZER_OPS", "STALE_AFTER_S", "StaleLock", "build_ops", "extensions_root", "prepare_for_initialize",
           "remove_stale_locks", "use_extensions_root"]

# A build of the shm op takes about 35 s on two busy cores; ten times that is no longer a build.
STALE_AFTER_S = float(os.environ.get("HPC_TRAIN_JIT_LOCK_STALE_S", "600"))
# The ops a job's config makes DeepSpeed compile, by train.optimizer. (DeepSpeed's CPU shm all-reduce, which it
# would compile on every first start, is switched off by hpc_train.rank.train.dscomm: training never calls it.)
OPTIMIZER_OPS: dict[str, tuple[str, ...]] = {"torch_adamw": (), "cpu_adam": ("CPUAdamBuilder",),
                                             "fused_adam": ("FusedAdamBuilder",)}


@dataclass(frozen=True)
class StaleLock:
    """A build lock that was removed, and how old it was."""

    path: Path
    age_s: float


def extensions_root() -> Path:
    """Where torch builds DeepSpeed's ops: ``TORCH_EXTENSIONS_DIR`` when the user set it, else a folder of torch's
    per-user cache (``~/.cache/torch_extensions/py311_cpu/``) keyed by this installation of DeepSpeed and torch.

    torch's own default is one folder for every environment of a user; a build there records the source paths of
    the environment that built it, so two virtual environments (a checkout and a CI clone, two projects) rebuild
    the op in turn in the same folder, each waiting on the other's lock."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    import deepspeed
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    install = f"{Path(deepspeed.__file__).resolve().parent}|{deepspeed.__version__}|{torch.__version__}"
    key = hashlib.sha256(install.encode()).hexdigest()[:12]
    return Path(get_default_build_root()) / f"{python}_{accelerator}" / f"hpc_train-{key}"


def use_extensions_root() -> Path:
    """Point torch (and so DeepSpeed) at :func:`extensions_root` for this process and its children."""
    root = extensions_root()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    return root


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _age_s(path: Path, now: float) -> float | None:
    try:
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return None


def remove_stale_locks(root: Path, stale_after_s: float = STALE_AFTER_S, wait: bool = True,
                       clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                       warn: Callable[[str], None] = _warn, ops: Collection[str] | None = None) -> list[StaleLock]:
    """Remove every ``<root>/<op>/lock`` (of ``ops`` only, when given) older than ``stale_after_s``. With
    ``wait``, a younger lock (a build in progress, perhaps on another node sharing the home folder) is waited on
    until it goes or turns stale.

    The age is read again just before removing, so a lock that a live builder has just created is left alone
    (a small window remains between that read and the unlink; torch's lock offers nothing better)."""
    removed: list[StaleLock] = []
    if not root.is_dir():
        return removed
    locks = sorted(root.glob("*/lock")) if ops is None else [root / op / "lock" for op in sorted(ops)]
    for lock in locks:
        while True:
            age = _age_s(lock, clock())
            if age is None:
                break
            if age > stale_after_s:
                again = _age_s(lock, clock())
                if again is not None and again > stale_after_s:
                    try:
                        lock.unlink()
                    except FileNotFoundError:
                        break
                    removed.append(StaleLock(lock, again))
                    warn(f"hpc_train: removed the build lock {lock}: it is {again:.0f} s old, left by a build that "
                         f"was killed (builds take well under {stale_after_s:.0f} s; set HPC_TRAIN_JIT_LOCK_STALE_S "
                         "to change that limit)")
                break
            if not wait:
                break
            sleep(min(1.0, stale_after_s - age + 0.01))
    return removed


def build_ops(names: tuple[str, ...] = (), stale_after_s: float = STALE_AFTER_S,
              warn: Callable[[str], None] = _warn) -> list[str]:
    """Clear stale locks, then load (building if needed) each op this accelerator has and can compile.
    Returns the names of the ops that were loaded."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builders = [get_accelerator().create_op_builder(name) for name in names]
    builders = [b for b in builders if b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False)]
    # Only the locks of the ops built here: another op's build (a long CUDA one) may be alive and older.
    remove_stale_locks(use_extensions_root(), stale_after_s, warn=warn, ops=[b.name for b in builders])
    for builder in builders:
        builder.load(verbose=False)
    return [builder.NAME for builder in builders]


def prepare_for_initialize(local_rank: int | None, barrier: Callable[[], None], names: tuple[str, ...] = ()) -> None:
    """One rank per node (local rank 0) builds the ops ``names`` (those the job's optimizer needs) while the
    others wait at ``barrier`` (a collective over all ranks), so no rank races the build or waits on a dead
    builder's lock. Without a known local rank every rank clears stale locks and loads; torch's lock then
    orders the builds."""
    use_extensions_root()  # every rank, before DeepSpeed loads an op
    if names and (local_rank is None or local_rank == 0):
        build_ops(names)
    if names:
        barrier()


def main(argv: list[str] | None = None) -> int:
    """Build the ops of the optimizers named (``cpu_adam``, ``fused_adam``) for this machine now, so that no job
    pays for (or hangs on) the first compile."""
    optimizers = sys.argv[1:] if argv is None else argv
    unknown = [name for name in optimizers if name not in OPTIMIZER_OPS]
    if unknown:
        print(f"jit_ops: unknown optimizer {unknown[0]!r}; use {', '.join(OPTIMIZER_OPS)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    loaded = build_ops(tuple(op for name in optimizers for op in OPTIMIZER_OPS[name]))
    names = ", ".join(loaded) or "none needed on this accelerator"
    print(f"jit_ops: ready in {time.monotonic() - started:.1f} s under {extensions_root()}: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
