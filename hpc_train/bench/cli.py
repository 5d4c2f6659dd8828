"""``python -m hpc_train bench OP``: time one collective over a size sweep and print nccl-tests style numbers.

Two ways to run: ``--ranks N`` (default 2 outside a job) spawns N local processes in a gloo group over
127.0.0.1; inside a job (RANK/WORLD_SIZE or SLURM_PROCID set, no ``--ranks``) every rank joins the job's
process group through :func:`hpc_train.rank.distributed.bootstrap.bootstrap` (NCCL on GPUs) and rank 0 prints.
Under srun
nothing needs setting: the rendezvous is the job's first node and a port derived from the job id, e.g.

    sbatch -N2 --ntasks-per-node=1 --wrap "srun python -m hpc_train bench allreduce --out bench.json"

Rank 0 names the nodes and the transport (NCCL's own log on GPUs; gloo says it has none) and, with ``--out``,
writes the JSON report to a file, so a batch job leaves it beside its log.

Options are checked before torch is imported, so ``--help`` and bad input answer at once.
Exit status: 0 done; 1 a failure at run time (a rank died, a wrong collective result); 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from hpc_train.bench.collectives import OPS, BenchError, Result
from hpc_train.common.terminal import json_text, plain
from hpc_train.errors import ConfigError, did_you_mean

__all__ = ["add_parser", "format_size", "format_table", "parse_size", "parse_sizes"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"([0-9]+)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_SIZES_FIX = "write bytes with an optional K, M or G suffix (powers of 1024): a sweep 1K..256M or a list 4K,1M"
DEFAULT_RANKS = 2


def parse_size(text: str) -> int:
    """Bytes of ``"1K"``, ``"256M"``, ``"4096"``; ConfigError naming the text otherwise."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ConfigError("--sizes", f'"{text}" is not a size', _SIZES_FIX)
    value = int(match[1]) * _UNITS[match[2].upper()]
    if value < 1:
        raise ConfigError("--sizes", f'"{text}" is 0 bytes', "sizes start at 1 byte (one float32 element)")
    return value


def parse_sizes(spec: str, factor: int = 4) -> list[int]:
    """Sizes in bytes, ascending: comma-separated sizes or ``LOW..HIGH`` sweeps multiplying by ``factor``."""
    sizes: set[int] = set()
    for part in spec.split(","):
        if ".." not in part:
            sizes.add(parse_size(part))
            continue
        low_text, _, high_text = part.partition("..")
        low, high = parse_size(low_text), parse_size(high_text)
        if low > high:
            raise ConfigError("--sizes", f'"{part}" runs downwards',
                              f"write the smaller size first: {high_text}..{low_text}")
        size = low
        while size <= high:
            sizes.add(size)
            size *= factor
    return sorted(sizes)


def format_size(nbytes: int) -> str:
    """``1K``, ``64M`` where the size is a whole number of units, else plain bytes."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def format_table(results: list[Result], title: str, notes: tuple[str, ...] = ()) -> str:
    """The text table rank 0 prints: one row per size, after the title and one ``#`` line per note."""
    header = (f"{'size':>8} {'count':>10} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13} "
              f"{'copy (GB/s)':>12} {'ratio':>8} {'check':>6}")
    lines = [f"# {title}", *(f"# {note}" for note in notes), header]
    for r in results:
        lines.append(f"{format_size(r.size):>8} {r.count:>10} {r.time_us:>12.1f} {r.algbw:>13.4f} {r.busbw:>13.4f} "
                     f"{r.copy_gbps:>12.2f} {r.ratio:>8.4f} {'ok' if r.correct else 'WRONG':>6}")
    lines.append("# busbw = algbw x factor (nccl-tests: allreduce 2(n-1)/n, allgather/reducescatter (n-1)/n, "
                 "broadcast 1); ratio = busbw / single-process copy; GB = 1e9 bytes")
    return "\n".join(lines)


def _in_job(env: os._Environ[str] | dict[str, str]) -> bool:
    return ("RANK" in env and "WORLD_SIZE" in env) or "SLURM_PROCID" in env


def _checked(args: argparse.Namespace) -> list[int]:
    """Every option checked before anything heavy is imported; the sizes in bytes."""
    if args.op not in OPS:
        hint = did_you_mean(args.op, OPS)
        raise ConfigError("bench", f'"{args.op}" is not a collective{", " + hint if hint else ""}',
                          f"choose one of {', '.join(OPS)}")
    if args.factor < 2:
        raise ConfigError("--factor", f"{args.factor} does not grow the sweep", "give 2 or more (default 4)")
    sizes = parse_sizes(args.sizes, args.factor)
    if args.ranks is not None and args.ranks < 1:
        raise ConfigError("--ranks", f"{args.ranks} local processes cannot run a collective",
                          f"give 1 or more, e.g. --ranks {DEFAULT_RANKS}")
    if args.iters < 1:
        raise ConfigError("--iters", f"{args.iters} timed calls measure nothing", "give 1 or more (default 20)")
    if args.warmup < 0:
        raise ConfigError("--warmup", f"{args.warmup} is negative", "give 0 or more (default 5)")
    if args.out is not None and _launch_rank() == 0:  # only rank 0 writes it; it may be local to its node
        _check_out(Path(args.out))
    return sizes


def _launch_rank() -> int:
    """This process's rank as the launcher gave it, before any process group (0 outside a job)."""
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        value = os.environ.get(name, "")
        if (value.isascii() and value.isdigit()):
            return int(value)
    return 0


def _check_out(path: Path) -> None:
    """The report file must be writable where rank 0 runs, checked before torch is imported: the one check of
    outputs (:func:`check_output`: a regular file or a new name in an existing folder, never a link, a FIFO, a
    device or a folder)."""
    from hpc_train.run.outputs import check_output

    check_output(path, example="bench.json")


def _in_job_results(args: argparse.Namespace, sizes: list[int]) -> tuple[list[Result], dict[str, Any], bool]:
    """Join the job's process group (the launcher's variables, as every rank of a job does) and measure.

    NCCL is asked for its INFO log in a private folder before the group starts; each rank keeps the lines
    that name a transport, and rank 0 receives every rank's lines and node name with one gather.
    """
    import torch

    from hpc_train.bench import report
    from hpc_train.bench.collectives import measure
    from hpc_train.rank.distributed.bootstrap import bootstrap, shutdown

    log_dir = tempfile.mkdtemp(prefix="hpc_train-bench-")
    try:
        pattern = report.request_nccl_log(os.environ, log_dir)
        context = bootstrap()
        nccl = context.backend == "nccl"
        device = torch.device("cuda", context.info.local_rank) if nccl else torch.device("cpu")
        results = measure(args.op, sizes, args.iters, args.warmup, device=device)
        mine = (report.node_name(), report.transport_lines(report.read_nccl_log(pattern)) if nccl else [])
        everyone = _gather(mine, context.info.world_size)
        shutdown()
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    transport = (report.nccl_transport([lines for _, lines in everyone], report.expects_ib()) if nccl
                 else report.gloo_transport())
    about = {"where": f"job ({context.info.launcher})", "backend": context.backend, "device": device.type,
             "hosts": [host for host, _ in everyone],
             "rendezvous": f"{context.rendezvous.addr}:{context.rendezvous.port}", **transport}
    return results, about, context.info.rank == 0


def _gather(mine: Any, world_size: int) -> list[Any]:
    """Every rank's ``mine``, in rank order, on every rank."""
    from hpc_train.rank.distributed.collectives import all_gather_objects

    everyone = all_gather_objects(mine)
    if len(everyone) != world_size:
        raise RuntimeError(f"gathered {len(everyone)} ranks, expected {world_size}")
    return everyone


def _local_results(args: argparse.Namespace, sizes: list[int]) -> tuple[list[Result], dict[str, Any], bool]:
    """``--ranks N`` processes on this machine, in a gloo group over loopback."""
    from hpc_train.bench.collectives import run_local
    from hpc_train.bench.report import gloo_transport

    ranks = args.ranks or DEFAULT_RANKS
    results = run_local(args.op, sizes, args.iters, args.warmup, ranks)
    about = {"where": "local", "backend": "gloo", "device": "cpu", "hosts": [socket.gethostname()] * ranks,
             **gloo_transport({"GLOO_SOCKET_IFNAME": "lo"})}  # what run_local's ranks set
    return results, about, True


def _report(args: argparse.Namespace, results: list[Result], about: dict[str, Any]) -> dict[str, Any]:
    """The JSON report (``--json``, ``--out``): the run's facts first, then one row per size."""
    return {"op": args.op, "world_size": results[0].world_size, **about, "iters": args.iters,
            "warmup": args.warmup, "results": [r.to_dict() for r in results]}


def _table(args: argparse.Namespace, results: list[Result], about: dict[str, Any]) -> str:
    from hpc_train.bench.report import describe_hosts

    title = (f"{args.op} on {results[0].world_size} ranks, {about['where']}, {about['backend']} on {about['device']}, "
             f"{describe_hosts(about['hosts'])}; mean of {args.iters} calls after {args.warmup} warm-up, slowest rank")
    return format_table(results, title, (f"transport: {about['transport']}",))


def _speak(args: argparse.Namespace, results: list[Result], about: dict[str, Any]) -> None:
    """Rank 0's output: the table or JSON on stdout, the JSON report in ``--out``, a fall-back on stderr."""
    report = _report(args, results, about)
    if args.out is not None:
        from hpc_train.run.outputs import write_output

        write_output(Path(args.out), json_text(report) + "\n", 0o644)
    print(json_text(report) if args.json else _table(args, results, about), flush=True)
    if about.get("socket_fallback"):
        print(plain(f"warning: bench {args.op}: {about['transport']}", one_line=True), file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    sizes = _checked(args)
    from hpc_train.rank.distributed.launchers import LaunchError
    from hpc_train.rank.distributed.rendezvous import RendezvousError

    try:
        if args.ranks is None and _in_job(os.environ):
            results, about, speaks = _in_job_results(args, sizes)
        else:
            results, about, speaks = _local_results(args, sizes)
    except (BenchError, LaunchError, RendezvousError) as error:
        print(plain(f"error: bench {args.op}: {error}", one_line=True), file=sys.stderr)
        return 1
    if speaks:
        try:
            _speak(args, results, about)
        except OSError as error:
            print(plain(f"error: bench {args.op}: cannot write the report {args.out}: {error}", one_line=True),
                  file=sys.stderr)
            return 1
    wrong = [format_size(r.size) for r in results if not r.correct]
    if wrong:
        if speaks:
            print(f"error: bench {args.op}: wrong collective result at {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


def add_parser(commands: Any) -> None:
    """Register ``bench`` on the main CLI's subcommands."""
    bench = commands.add_parser("bench", help="time a collective (nccl-tests style algbw/busbw)",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("op", metavar="OP", help=f"the collective: {', '.join(OPS)}")
    bench.add_argument("--sizes", default="1K..256M",
                       help="bytes: a sweep LOW..HIGH (x --factor) or a list 4K,1M (default 1K..256M)")
    bench.add_argument("--factor", type=int, default=4, help="sweep multiplier (default 4)")
    bench.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    bench.add_argument("--ranks", type=int, metavar="N",
                       help=f"spawn N local processes in a gloo group (default {DEFAULT_RANKS} outside a job; "
                            "inside one, without --ranks, the job's ranks are used)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--out", metavar="FILE",
                       help="rank 0 also writes the JSON report to FILE (relative to its working directory)")
    bench.set_defaults(run=_run)
