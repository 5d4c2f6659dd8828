"""Time collectives on a torch.distributed group and report nccl-tests style bandwidths.

Why: before a long run, a few seconds of all-reduce timing show whether the ranks talk over InfiniBand,
NVLink or a slow socket fall-back. The numbers follow nccl-tests (doc/PERFORMANCE.md) so they compare with
what a site's admins measure: ``algbw = bytes / time`` and ``busbw = algbw x factor``, where the factor makes
the figure comparable to the hardware's peak link bandwidth whatever the rank count.

Beside every size a single-process memory copy of the same bytes is timed: ``busbw / copy`` says how far the
collective is from moving memory locally (on CPU/gloo it is the honest baseline; on GPUs it is a device copy).

torch is imported only inside the functions that measure, so the formulas and the NCCL log parser stay
cheap to import (the CLI's ``--help`` and bad input never load torch).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["OPS", "BenchError", "NotSupportedError", "Result", "TransportReport", "bandwidths", "bus_factor",
           "measure", "parse_nccl_log", "run_local", "transport_from_nccl_log"]

OPS = ("allreduce", "allgather", "reducescatter", "broadcast")
FLOAT_BYTES = 4  # float32 elements, as nccl-tests' default -d float
GB = 1e9  # nccl-tests reports GB/s in powers of ten


class BenchError(RuntimeError):
    """A benchmark failed at run time (a rank died, a collective raised); the message says which rank and why."""


class NotSupportedError(BenchError):
    """The backend cannot run this collective at all (e.g. reduce-scatter on an old gloo)."""


@dataclass(frozen=True)
class Result:
    """One size of one collective: the slowest rank's mean time, its bandwidths and the local copy baseline."""

    op: str
    size: int  # bytes, as nccl-tests counts them (the full output of allgather, the full input of reducescatter)
    count: int  # float32 elements in that buffer
    world_size: int
    time_us: float
    algbw: float  # GB/s
    busbw: float  # GB/s
    copy_gbps: float  # GB/s of a single-process Tensor.copy_ of the same bytes
    ratio: float  # busbw / copy_gbps
    correct: bool  # the collective's values were checked once before timing

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------- formulas


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: what each rank must move per byte of result, relative to one link."""
    if world_size < 1:
        raise ValueError(f"world size {world_size} is below 1")
    n = world_size
    factors = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reducescatter": (n - 1) / n,
               "broadcast": 1.0}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")
    return factors[op]


def bandwidths(op: str, size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s for one call of ``op`` on ``size_bytes`` that took ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"time {seconds} s is not positive")
    algbw = size_bytes / seconds / GB
    return algbw, algbw * bus_factor(op, world_size)


def element_counts(op: str, size_bytes: int, world_size: int) -> tuple[int, int]:
    """``(total, per_rank)`` float32 elements for a requested size: whole elements, at least one per rank.

    allgather and reducescatter split the buffer in ``world_size`` equal chunks, so the total is rounded down
    to a multiple of the world size (nccl-tests does the same).
    """
    total = max(1, size_bytes // FLOAT_BYTES)
    if op in ("allgather", "reducescatter"):
        chunk = max(1, total // world_size)
        return chunk * world_size, chunk
    return total, total


# --------------------------------------------------------------------------------------- NCCL log parser

_USING = re.compile(r"NET/(\w+)\s*:\s*Using\s+(.*)")
_VIA = re.compile(r"\bvia\s+(\S+(?: pointer)?)")
_DEVICE = re.compile(r"\[[0-9]+\]([^\s\[]+)")


@dataclass(frozen=True)
class TransportReport:
    """What an NCCL_DEBUG=INFO log says about how ranks connect."""

    transports: tuple[str, ...]  # per channel, first seen first: "P2P/IPC", "SHM", "NET/IB", "NET/Socket"
    net: str | None  # the network plugin NCCL chose ("IB", "Socket"), from "NET/X : Using"
    devices: tuple[str, ...]  # its devices ("mlx5_0:1", "eth0")
    ib_expected: bool  # NCCL tried IB (NET/IB lines beyond "No device found") or the caller expected it
    socket_fallback: bool  # sockets carry inter-node traffic although IB was expected


def _normalise_via(token: str) -> str:
    parts = token.split("/")
    if parts[0] in ("NET", "P2P") and len(parts) > 1:
        return "/".join(parts[:2])
    return parts[0]


def _device_name(net: str, raw: str) -> str:
    return raw.split(":")[0] if net == "Socket" else raw.split("/")[0]


def parse_nccl_log(text: str, expect_ib: bool = False) -> TransportReport:
    """Read the transport lines of an NCCL_DEBUG=INFO log; any other line is ignored.

    ``NET/IB : No device found`` alone does not make IB expected: NCCL prints it on every node without RDMA
    devices, where sockets are the only way and no fall-back. Pass ``expect_ib`` when the node shows IB ports.
    """
    transports: list[str] = []
    net, devices = None, []
    ib_mentioned = expect_ib
    for line in text.splitlines():
        if "NET/IB" in line and "No device found" not in line:
            ib_mentioned = True
        using = _USING.search(line)
        if using:
            net = using[1]
            devices = [_device_name(net, raw) for raw in _DEVICE.findall(using[2])]
        via = _VIA.search(line)
        if via:
            name = _normalise_via(via[1])
            if name not in transports:
                transports.append(name)
    uses_socket = "NET/Socket" in transports or (net == "Socket" and not any(t.startswith("NET/") for t in transports))
    uses_ib = "NET/IB" in transports or (net == "IB" and "NET/Socket" not in transports)
    return TransportReport(tuple(transports), net, tuple(devices), ib_mentioned,
                           uses_socket and ib_mentioned and not uses_ib)


def transport_from_nccl_log(text: str, expect_ib: bool = False) -> str | None:
    """One line naming the transport(s) of an NCCL_DEBUG=INFO log, or None when it says nothing about them."""
    report = parse_nccl_log(text, expect_ib)
    if not report.transports and report.net is None:
        return None
    names = list(report.transports)
    if report.net and not any(name.startswith("NET/") for name in names):
        names.append(f"NET/{report.net}")  # one node: the plugin is loaded but no channel crosses the network
    line = ", ".join(names)
    if report.net and report.devices:
        line += f" (NET/{report.net} on {', '.join(report.devices)})"
    if report.socket_fallback:
        line += ("; WARNING: fell back to sockets although InfiniBand was expected: check NCCL_IB_HCA, "
                 "NCCL_SOCKET_IFNAME and that the IB devices are visible in the job")
    return line


# ------------------------------------------------------------------------------------------- measuring


def _call(op: str, out: Any, inp: Any, group: Any) -> None:
    """One call of the collective; ``out`` is the receive buffer (the same tensor as ``inp`` for in-place ops)."""
    import torch.distributed as dist

    if op == "allreduce":
        dist.all_reduce(inp, group=group)
    elif op == "broadcast":
        dist.broadcast(inp, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    elif op == "allgather":
        _newest(dist, "all_gather_single", "all_gather_into_tensor")(out, inp, group=group)
    elif op == "reducescatter":
        _reduce_scatter(out, inp, group)
    else:
        raise ValueError(f"unknown collective {op!r}")


def _newest(module: Any, new: str, old: str) -> Any:
    """torch 2.13 renamed the tensor forms (``*_into_tensor``/``*_tensor`` -> ``*_single``) and warns on the old
    names; same arguments, so take whichever this torch has."""
    return getattr(module, new, None) or getattr(module, old)


def _reduce_scatter(out: Any, inp: Any, group: Any) -> None:
    """``reduce_scatter_tensor``, or the list form where the backend lacks the tensor form (older gloo)."""
    import torch.distributed as dist

    try:
        _newest(dist, "reduce_scatter_single", "reduce_scatter_tensor")(out, inp, group=group)
    except (RuntimeError, NotImplementedError) as first:
        try:
            dist.reduce_scatter(out, list(inp.chunk(dist.get_world_size(group))), group=group)
        except (RuntimeError, NotImplementedError) as second:
            backend = dist.get_backend(group)
            raise NotSupportedError(f"reducescatter is not supported by {backend} in this torch "
                               f"({str(first).splitlines()[0]}; {str(second).splitlines()[0]}): "
                               "run it with NCCL on GPUs") from None


def _buffers(op: str, size_bytes: int, world_size: int, device: Any) -> tuple[Any, Any]:
    """``(out, inp)`` float32 buffers of the op at this size, zero-filled (repeated sums stay finite)."""
    import torch

    total, chunk = element_counts(op, size_bytes, world_size)
    if op == "allgather":
        return torch.zeros(total, device=device), torch.zeros(chunk, device=device)
    if op == "reducescatter":
        return torch.zeros(chunk, device=device), torch.zeros(total, device=device)
    buffer = torch.zeros(total, device=device)
    return buffer, buffer


def _check(op: str, size_bytes: int, group: Any, device: Any) -> bool:
    """Run the op once on known values and compare with the expected answer; every rank agrees on the verdict."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out, inp = _buffers(op, size_bytes, n, device)
    inp.fill_(float(rank + 1))
    _call(op, out, inp, group)
    if op in ("allreduce", "reducescatter"):
        expected = torch.full_like(out, n * (n + 1) / 2)
    elif op == "allgather":
        expected = torch.arange(1, n + 1, dtype=out.dtype, device=device).repeat_interleave(out.numel() // n)
    else:
        expected = torch.ones_like(out)  # the group's rank 0 sent rank + 1 = 1
    verdict = torch.tensor([1 if torch.equal(out, expected) else 0], dtype=torch.int32, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    return bool(verdict.item())


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time_collective(op: str, size_bytes: int, iters: int, warmup: int, group: Any, device: Any) -> float:
    """Seconds per call: the mean over ``iters`` on each rank, then the slowest rank's (all-reduce MAX)."""
    import torch
    import torch.distributed as dist

    out, inp = _buffers(op, size_bytes, dist.get_world_size(group), device)
    for _ in range(warmup):
        _call(op, out, inp, group)
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        _call(op, out, inp, group)
    _sync(device)
    mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
    return float(mean.item())


def _time_copy(nbytes: int, iters: int, warmup: int, device: Any) -> float:
    """Seconds per ``Tensor.copy_`` of ``nbytes`` in this one process: the local memory baseline."""
    import torch

    count = max(1, nbytes // FLOAT_BYTES)
    src, dst = torch.ones(count, device=device), torch.empty(count, device=device)
    for _ in range(warmup):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return (time.perf_counter() - start) / iters


def _copy_baseline(nbytes: int, iters: int, warmup: int, group: Any, device: Any) -> float:
    """Copy seconds measured on the group's rank 0 alone (the others wait, so they do not share its memory
    bandwidth), then sent to every rank so all return the same results."""
    import torch
    import torch.distributed as dist

    seconds = torch.zeros(1, dtype=torch.float64, device=device)
    if dist.get_rank(group) == 0:
        seconds.fill_(_time_copy(nbytes, iters, warmup, device))
    dist.broadcast(seconds, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return float(seconds.item())


def measure(op: str, sizes: list[int], iters: int, warmup: int, group: Any = None,
            device: Any = "cpu") -> list[Result]:
    """Time ``op`` at each size (bytes) on an initialised process group; every rank must call it alike.

    Raises NotSupportedError when the backend cannot run ``op``, ValueError on an unknown op or bad counts.
    """
    import torch.distributed as dist

    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters {iters} must be at least 1 and warmup {warmup} not negative")
    n = dist.get_world_size(group)
    results = []
    for requested in sizes:
        total, _ = element_counts(op, requested, n)
        nbytes = total * FLOAT_BYTES
        correct = _check(op, nbytes, group, device)
        seconds = _time_collective(op, nbytes, iters, warmup, group, device)
        copy_s = _copy_baseline(nbytes, iters, warmup, group, device)
        algbw, busbw = bandwidths(op, nbytes, seconds, n)
        copy_gbps = nbytes / copy_s / GB
        results.append(Result(op, nbytes, total, n, seconds * 1e6, algbw, busbw, copy_gbps, busbw / copy_gbps,
                              correct))
    return results


# ----------------------------------------------------------------------------------- local gloo ranks


def _local_rank_main(rank: int, world_size: int, port: int, op: str, sizes: list[int], iters: int, warmup: int,
                     conn: Connection) -> None:
    """One spawned rank: join the gloo group through the parent's store, measure, report, leave via _exit.

    It waits on the store until every rank has reported before leaving, so no rank closes its sockets while a
    peer still finishes the last collective; ``os._exit`` skips an interpreter teardown that can abort on CPU.
    """
    code = 0
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share this machine's cores
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=300))
        results = measure(op, sizes, iters, warmup)
        conn.send(("ok", [result.to_dict() for result in results] if rank == 0 else None))
        store.set(f"bench-done-{rank}", "1")
        store.wait([f"bench-done-{r}" for r in range(world_size)], timedelta(seconds=60))
    except NotSupportedError as error:
        conn.send(("error", str(error)))
        code = 1
    except BaseException as error:
        conn.send(("error", f"rank {rank}: {error!r}\n{traceback.format_exc()}"))
        code = 1
    with contextlib.suppress(BaseException):
        conn.close()
    os._exit(code)


def _collect(processes: list[Any], readers: list[Connection]) -> list[Any]:
    """Each rank's report, in rank order; BenchError on the first error or a rank that died without one.

    The parent closed its copies of the writers, so a rank that dies makes its reader ready with EOF.
    """
    reports: list[Any] = [None] * len(readers)
    pending = {reader: rank for rank, reader in enumerate(readers)}
    while pending:
        for ready in wait(list(pending)):
            rank = pending.pop(ready)  # type: ignore[call-overload]
            try:
                reports[rank] = ready.recv()  # type: ignore[union-attr]
            except EOFError:
                processes[rank].join(timeout=5)
                raise BenchError(f"rank {rank} exited without a result (exit status "
                                 f"{processes[rank].exitcode})") from None
            if reports[rank][0] == "error":
                kind = NotSupportedError if "not supported by" in reports[rank][1] else BenchError
                raise kind(reports[rank][1])
    return reports


def run_local(op: str, sizes: list[int], iters: int, warmup: int, ranks: int) -> list[Result]:
    """Spawn ``ranks`` processes on this machine in a gloo group over 127.0.0.1 and measure ``op`` there.

    The parent hosts the rendezvous store on a port the kernel picks (no race for a free port), collects rank
    0's results through a pipe and stops only the processes it started.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    processes, readers = [], []
    try:
        for rank in range(ranks):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=_local_rank_main, name=f"bench-rank-{rank}", daemon=True,
                                      args=(rank, ranks, store.port, op, sizes, iters, warmup, writer))
            process.start()
            writer.close()  # the child holds the only writer: EOF here means it is gone
            processes.append(process)
            readers.append(reader)
        reports = _collect(processes, readers)
        for process in processes:
            process.join(timeout=30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [Result(**row) for row in reports[0][1]]
