"""Run a function on N real processes joined in a gloo process group, and judge what they REPORT.

Why not the exit codes alone: on this CPU platform a rank occasionally aborts at interpreter exit
("terminate called without an active exception") after all its work has passed. So each worker:

* writes its result to ``rank<N>.pt`` (atomically: temporary file, then rename) BEFORE tearing anything down,
* then destroys the process group and leaves through ``os._exit``, skipping the interpreter and C++ teardown
  where that abort happens; rank 0, which hosts the rendezvous store, leaves last.

The parent waits for every result file (or the first error file), kills only the workers it started, and
returns the results; an exit status that is not 0 after a complete result is ignored.

Rendezvous: rank 0 opens the TCPStore on 127.0.0.1 port 0 (the kernel picks a free port, no bind/close race
with other test runs) and publishes the port through a file in the run's temporary directory.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["WorkersFailedError", "run_workers"]


class WorkersFailedError(AssertionError):
    """Some rank did not report a result; the message holds every rank's traceback or exit status."""


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _rendezvous(rank: int, world_size: int, workdir: Path, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    port_file = workdir / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        _write_atomic(port_file, lambda p: p.write_text(str(store.port), encoding="utf-8"))
        return store
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no rendezvous port within {timeout_s} s")
        time.sleep(0.02)
    port = int(port_file.read_text(encoding="utf-8"))
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


def _worker_main(target: Callable[[int, int], Any], rank: int, world_size: int, workdir: str,
                 timeout_s: float) -> None:
    """Entry point of one spawned worker: join the group, run ``target``, report, leave via ``os._exit``."""
    folder = Path(workdir)
    code = 0
    store = None
    reported = False
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = _rendezvous(rank, world_size, folder, timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        result = target(rank, world_size)
        _write_atomic(folder / f"rank{rank}.pt", lambda p: torch.save(result, p))
        reported = True
        dist.destroy_process_group()
    except BaseException:
        code = 1
        # An error after the result was reported (teardown) is kept for reading, but is not a failure.
        name = f"rank{rank}.teardown-error" if reported else f"rank{rank}.error"
        with contextlib.suppress(BaseException):
            (folder / name).write_text(traceback.format_exc(), encoding="utf-8")
    with contextlib.suppress(BaseException):
        if store is not None:
            if rank == 0:  # keep the store up until every other rank is through its teardown
                store.wait([f"exited{r}" for r in range(1, world_size)], timedelta(seconds=10))
            else:
                store.set(f"exited{rank}", "1")
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_workers(target: Callable[[int, int], Any], world_size: int, timeout_s: float = 120.0) -> list[Any]:
    """Run ``target(rank, world_size)`` on ``world_size`` spawned processes in one gloo group; results by rank.

    ``target`` must be picklable (a module-level function or a functools.partial of one) and return something
    ``torch.save`` can write and ``torch.load(weights_only=True)`` can read (tensors, numbers, strings, lists,
    dicts). Raises WorkersFailedError when a rank reports an error or no result within ``timeout_s``.
    """
    import torch

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hpc-train-mp-") as tmp:
        folder = Path(tmp)
        results = [folder / f"rank{rank}.pt" for rank in range(world_size)]
        errors = [folder / f"rank{rank}.error" for rank in range(world_size)]
        processes = [context.Process(target=_worker_main, args=(target, rank, world_size, tmp, timeout_s),
                                     name=f"tp-worker-{rank}", daemon=True) for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if all(path.exists() for path in results):
                    break
                if any(path.exists() for path in errors):
                    break
                if all(not process.is_alive() for process in processes):
                    break
                time.sleep(0.05)
            if all(path.exists() for path in results):
                # Complete results: give the workers a moment to leave on their own (teardown), then stop them.
                grace_end = time.monotonic() + 15.0
                for process in processes:
                    process.join(timeout=max(0.0, grace_end - time.monotonic()))
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        reports = []
        for rank, process in enumerate(processes):
            if results[rank].exists():
                continue
            detail = (errors[rank].read_text(encoding="utf-8") if errors[rank].exists()
                      else f"no result, exit status {process.exitcode} (killed if negative)")
            reports.append(f"--- rank {rank} ---\n{detail}")
        if reports:
            raise WorkersFailedError(f"{len(reports)} of {world_size} ranks reported no result:\n" + "\n".join(reports))
        return [torch.load(path, weights_only=True) for path in results]
