"""``python -m hpc_train.launch RUN_DIR``: the entry every rank runs, from any launcher; the name sbatch scripts,
torchrun and mpirun type, kept as the door to :mod:`hpc_train.rank.entry`. :class:`RankEntry` is the callable
submitit pickles on the login node: this module imports nothing of the rank side until a rank calls it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hpc_train.run.paths import PROGRAM_FILE, TRAIN_FILE

__all__ = ["RankEntry", "main"]


class RankEntry:
    """The callable submitit pickles: it holds only the run folder, and imports nothing heavy until called."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> dict[str, Any]:
        from hpc_train.rank.agent.agent import agent_setup, supervise
        from hpc_train.rank.entry import run_rank

        run_dir = Path(self.run_dir)
        setup = agent_setup(run_dir)
        if setup is None:
            return run_rank(run_dir)
        code = supervise(setup)  # the rank runs below an agent that may start it again inside this job
        if code != 0:
            raise SystemExit(code)
        results = [run_dir / name for name in (TRAIN_FILE, PROGRAM_FILE) if (run_dir / name).exists()]
        return json.loads(results[0].read_text(encoding="utf-8")) if setup.node == 0 and results else {}

    def checkpoint(self) -> Any:
        """submitit calls this when its own signal handler still holds the preemption signal (the first moments
        of a rank, before :func:`run_rank` installs ours): requeue as is; the run folder holds the state."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(RankEntry(self.run_dir))


def main(argv: list[str] | None = None) -> int:
    from hpc_train.rank.entry import main as rank_main

    return rank_main(argv)


def __getattr__(name: str) -> Any:
    """The rest of ``hpc_train.rank.entry``, for code written against the old name."""
    import importlib

    return getattr(importlib.import_module("hpc_train.rank.entry"), name)


if __name__ == "__main__":
    sys.exit(main())
