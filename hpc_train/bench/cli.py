"""``python -m hpc_train bench OP``: time one collective over a size sweep and print nccl-tests style numbers.

Two ways to run: ``--ranks N`` (default 2 outside a job) spawns N local processes in a gloo group over
127.0.0.1; inside a job (RANK/WORLD_SIZE or SLURM_PROCID set, no ``--ranks``) every rank joins the job's
process group through :func:`hpc_train.dist.bootstrap.bootstrap` (NCCL on GPUs) and rank 0 prints.

Options are checked before torch is imported, so ``--help`` and bad input answer at once.
Exit status: 0 done; 1 a failure at run time (a rank died, a wrong collective result); 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from hpc_train.bench.collectives import OPS, BenchError, Result
from hpc_train.errors import ConfigError, did_you_mean

__all__ = ["add_parser", "format_size", "format_table", "parse_size", "parse_sizes"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"(\d+)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
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


def format_table(results: list[Result], title: str) -> str:
    """The text table rank 0 prints: one row per size."""
    header = (f"{'size':>8} {'count':>10} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13} "
              f"{'copy (GB/s)':>12} {'ratio':>8} {'check':>6}")
    lines = [f"# {title}", header]
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
    return sizes


def _in_job_results(args: argparse.Namespace, sizes: list[int]) -> tuple[list[Result], dict[str, Any], bool]:
    """Join the job's process group (the launcher's variables, as every rank of a job does) and measure."""
    import torch

    from hpc_train.bench.collectives import measure
    from hpc_train.dist.bootstrap import bootstrap, shutdown

    context = bootstrap()
    device = torch.device("cuda", context.info.local_rank) if context.backend == "nccl" else torch.device("cpu")
    results = measure(args.op, sizes, args.iters, args.warmup, device=device)
    shutdown()
    about = {"where": f"job ({context.info.launcher})", "backend": context.backend, "device": device.type}
    return results, about, context.info.rank == 0


def _run(args: argparse.Namespace) -> int:
    sizes = _checked(args)
    from hpc_train.dist.launchers import LaunchError
    from hpc_train.dist.rendezvous import RendezvousError

    try:
        if args.ranks is None and _in_job(os.environ):
            results, about, speaks = _in_job_results(args, sizes)
        else:
            from hpc_train.bench.collectives import run_local

            ranks = args.ranks or DEFAULT_RANKS
            results, speaks = run_local(args.op, sizes, args.iters, args.warmup, ranks), True
            about = {"where": "local", "backend": "gloo", "device": "cpu"}
    except (BenchError, LaunchError, RendezvousError) as error:
        print(f"error: bench {args.op}: {error}", file=sys.stderr)
        return 1
    if not speaks:
        return 0 if all(r.correct for r in results) else 1
    world = results[0].world_size
    if args.json:
        print(json.dumps({"op": args.op, "world_size": world, **about, "iters": args.iters, "warmup": args.warmup,
                          "results": [r.to_dict() for r in results]}, indent=2))
    else:
        print(format_table(results, f"{args.op} on {world} ranks, {about['where']}, {about['backend']} on "
                                    f"{about['device']}; mean of {args.iters} calls after {args.warmup} warm-up, "
                                    "slowest rank"))
    wrong = [format_size(r.size) for r in results if not r.correct]
    if wrong:
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
    bench.set_defaults(run=_run)
