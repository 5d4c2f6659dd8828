"""A standby rank: ``python -u -m hpc_train.rank.agent.standby_main KIND READY_FD AGENT_PID``, started by a
node's agent (:mod:`hpc_train.rank.agent.standby`) so that the next life's rank skips its imports; it ends with
that agent.

It imports what a rank of ``KIND`` (``train``: the built-in trainer; ``program``: a user's function or script)
imports first, torch above all (about 4 s of a CPU rank's 5 s start), writes one byte to READY_FD (a pipe
to the agent), then waits on its standard input for one
line: the rank's command and environment, as JSON. It then becomes that rank: the environment replaced, the
command's module run as ``__main__``, exactly as ``python -u -m hpc_train.launch RUN_DIR`` would. A trainer's
standby keeps its standard input and READY_FD as the rank's channel to the agent (``HPC_TRAIN_REJOIN``,
:mod:`hpc_train.rank.agent.rejoin`): the rank may then train later lives in this process too. What it must
not do before that line: initialise CUDA (the device a rank sees is fixed at the first CUDA call), open a process
group, or import the user's code (its import may have effects the rank's start must own).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from typing import Any

from hpc_train.rank.agent.rejoin import REJOIN_ENV

__all__ = ["KINDS", "WARM_MODULES", "become", "main", "take_order"]

# What each kind of rank imports on its way to its first step (benchmarks/rank_start.py measured the ladder):
# torch._dynamo and torch._inductor's compile_fx are imported by the first torch optimizer and by DeepSpeed's ZeRO.
WARM_MODULES = {
    "train": ("torch", "deepspeed", "hpc_train.rank.entry", "hpc_train.rank.train.trainer", "torch._dynamo",
              "torch._inductor.compile_fx"),
    "program": ("torch", "hpc_train.rank.entry", "hpc_train.rank.program.runner", "torch._dynamo"),
}
KINDS = tuple(WARM_MODULES)


def warm(kind: str) -> None:
    """Import ``kind``'s modules; one that fails to import is left to the rank, which reports it as it would.

    DeepSpeed's import asks ``torch.cuda.is_available()``, which would initialise the CUDA driver (and fix the
    devices it sees) in this process; asked through NVML instead, it does not. The variable is this process's
    alone: :func:`become` replaces the whole environment with the rank's."""
    import importlib

    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for name in WARM_MODULES[kind]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S112 - the rank imports it again and says what is wrong, in its own log
            continue
    from hpc_train.rank.runtime.heap import freeze_imports

    freeze_imports()


_OOM_SCORE = "/proc/self/oom_score_adj"


def _oom_score(value: str | None = None) -> str:
    """This process's ``oom_score_adj`` (read, or set to ``value``); "" where Linux has none. An idle standby
    asks to be the kernel's first choice when the node runs out of memory: losing one costs only a cold start,
    losing a rank costs the life. Raising it needs no privilege, and lowering it back to where it was neither."""
    try:
        if value is None:
            with open(_OOM_SCORE, encoding="ascii") as handle:
                return handle.read().strip()
        with open(_OOM_SCORE, "w", encoding="ascii") as handle:
            handle.write(value)
    except OSError:
        return ""
    return value


def take_order(order: dict[str, Any]) -> str:
    """Make this process the rank ``order`` names (``argv``: ``[python, -u, -m, MODULE, ARGS...]``, ``env``: its
    environment, ``cpus``: its share of the node's): its CPUs, its environment and ``sys.argv``, as its own
    interpreter would have them; returns MODULE. A standby runs it next, a warm rank its entry again."""
    argv, env = order["argv"], order["env"]
    if order.get("oom_score_adj"):
        _oom_score(order["oom_score_adj"])  # a rank again: as likely to be chosen as a rank started cold
    if order.get("cpus"):  # the threads its imports started too, not only the one the agent can reach
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(thread), set(order["cpus"]))
    module = argv[argv.index("-m") + 1]
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv[argv.index("-m") + 2:]]
    return module


def become(order: dict[str, Any]) -> None:
    """Run the rank ``order`` names in this process (:func:`take_order`), as its own interpreter would have."""
    runpy.run_module(take_order(order), run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in KINDS or not args[1].isdigit() or not args[2].isdigit():
        print(f"usage: python -m hpc_train.rank.agent.standby_main {{{','.join(KINDS)}}} READY_FD AGENT_PID",
              file=sys.stderr)
        return 2
    from hpc_train.run.procs import tie_to_parent

    if not tie_to_parent(int(args[2])):  # killed with its agent; an agent already gone has no use for it
        return 0
    started_at = _oom_score()
    if started_at:
        _oom_score("1000")
    warm(args[0])
    tell = int(args[1])
    with contextlib.suppress(OSError):  # the agent counts its ready standbys by these
        os.write(tell, b"1")
    line = sys.stdin.readline()
    if not line:  # the agent closed the pipe without a rank for it: nothing to do
        return 0
    order = {**json.loads(line), "oom_score_adj": started_at}
    if args[0] == "train":  # the rank may outlive its life: the agent's pipes stay its channel (rank/agent/rejoin)
        order["env"] = {**order["env"], REJOIN_ENV: f"0,{tell}"}
    else:
        with contextlib.suppress(OSError):
            os.close(tell)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the rank reads nothing from the agent's pipe, as srun's tasks read nothing by default
        os.close(null)
    become(order)  # a trainer's entry moves standard input (its orders) aside itself (RejoinChannel.adopt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
