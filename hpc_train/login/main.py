"""``hpc_train COMMAND`` (or ``python -m hpc_train COMMAND``): submit, validate, render, follow and inspect runs
from a login node. ``python -m hpc_train.submit`` is the same as ``hpc_train submit``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpc_train import __version__
from hpc_train.backends import default_executor
from hpc_train.bench.cli import add_parser as add_bench_parser
from hpc_train.common.terminal import plain, print_json, shown
from hpc_train.login.ckpt_cli import add_parser as add_ckpt_parser
from hpc_train.login.cli.common import (
    ArgumentParser,
    add_plan_arguments,
    plan_from_args,
    prepare_plan_folder,
    run_command,
)
from hpc_train.login.cli.run import add_run_parser
from hpc_train.login.doctor.cli import add_parser as add_doctor_parser
from hpc_train.login.ops.cli import add_cancel_parser, add_logs_parser, add_plot_parser, add_status_parser
from hpc_train.login.submit import SUMMARY as SUBMIT_SUMMARY
from hpc_train.login.submit import add_submit_arguments

__all__ = ["main"]

_ABOUT = ("Submit, run, validate, render, follow, cancel and inspect hpc_train runs from a login node. "
          "'hpc_train submit' is 'python -m hpc_train.submit'; 'hpc_train COMMAND --help' says more.")


def _layout_for_world(args: argparse.Namespace) -> int:
    """The rank layout of the config's parallel sizes at any world size, without the job's node shape."""
    from hpc_train.common.topology import Topology
    from hpc_train.config.plan import load_job
    from hpc_train.config.validate import MAX_WORLD
    from hpc_train.errors import ConfigError

    cfg = load_job(args.config, args.overrides)
    par = cfg.parallel
    if not 1 <= args.world <= MAX_WORLD:
        raise ConfigError("--world", f"{str(args.world)[:30]} ranks is outside 1..{MAX_WORLD:,}",
                          "give a real world size")
    try:
        topology = Topology.build(args.world, tp=par.tensor, pp=par.pipeline, cp=par.context, order=par.order)
    except ValueError as error:
        raise ConfigError("--world", str(error)) from None
    batch = cfg.train.micro_batch * cfg.train.grad_accum * topology.sizes["dp"]
    rows = [*topology.summary(), ("global batch", f"{batch} = micro {cfg.train.micro_batch} x accum "
                                                   f"{cfg.train.grad_accum} x data {topology.sizes['dp']}")]
    if args.json:
        print_json({"sizes": topology.sizes, "order": list(topology.order), "global_batch": batch}, indent=None)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=shown(f"Layout of {args.config} at {args.world} ranks"), show_header=False,
                  title_justify="left")
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
    return 0


def _at_world(args: argparse.Namespace) -> argparse.Namespace:
    """``--memory --world N``: the job with ``job.nodes = N / tasks_per_node`` (its nodes' shape kept)."""
    from hpc_train.config.plan import load_job
    from hpc_train.errors import ConfigError

    per_node = load_job(args.config, args.overrides).job.tasks_per_node
    if args.world < 1 or args.world % per_node:
        raise ConfigError("--world", f"{str(args.world)[:30]} ranks is not a whole number of nodes of "
                          f"{per_node} tasks (job.tasks_per_node)", f"give a multiple of {per_node}, or "
                          "--set job.tasks_per_node=... to change the nodes' shape")
    return argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, f"job.nodes={args.world // per_node}"]})


def _planned_executor(args: argparse.Namespace) -> str:
    """The executor a plan is checked for; validate never submits, so sbatch need not be on PATH here."""
    from hpc_train.config.sites import load_site

    if args.executor != "auto":
        return args.executor
    return default_executor(load_site(args.site).slurm.enabled)


def _memory(args: argparse.Namespace) -> int:
    """Bytes per rank of parameters, gradients, optimizer state and activations, against the site's GPUs: as
    DeepSpeed keeps them, or as FSDP2 does for ``train.engine = "fsdp2"``."""
    import dataclasses

    from hpc_train.config.memory import fsdp2_memory_plan, memory_plan
    from hpc_train.config.memory_rows import memory_rows
    from hpc_train.config.sites import load_site
    from hpc_train.errors import ConfigError

    plan = plan_from_args(args, executor=_planned_executor(args))
    cfg, lay = plan.config, plan.layout
    gpu_mem_gb, train = load_site(args.site).node.gpu_mem_gb, cfg.train
    common = {"grad_accum": lay.grad_accum, "gpus_per_node": plan.resources.gpus_per_node,
              "parameters": train.parameters}
    try:
        if train.engine == "fsdp2":  # validate refuses pipeline and context parallelism for FSDP2
            memory = fsdp2_memory_plan(train.model, cfg.data.vocab_size, train.seq_len, lay.micro_batch,
                                       lay.tensor, lay.data, train.precision, gpu_mem_gb, offload=cfg.fsdp.offload,
                                       reshard_after_forward=cfg.fsdp.reshard_after_forward, **common)
        else:
            memory = memory_plan(train.model, cfg.data.vocab_size, train.seq_len, lay.micro_batch, lay.tensor,
                                 lay.pipeline, lay.data, cfg.zero.stage, train.precision, cfg.zero.offload_optimizer,
                                 cfg.zero.offload_params, gpu_mem_gb, bucket_size=cfg.zero.bucket_size,
                                 overlap_comm=cfg.zero.overlap_comm, **common)
    except ValueError as error:
        where = "train.parameters" if "train.parameters" in str(error) or "parameters = " in str(error) else "--memory"
        raise ConfigError(where, str(error)) from None
    if args.json:
        print_json(dataclasses.asdict(memory), default=str)
        return 0
    from rich.console import Console
    from rich.table import Table

    engine = "FSDP2" if train.engine == "fsdp2" else "DeepSpeed"
    table = Table(title=shown(f"Memory per rank: {train.model} with {engine} on {plan.site}"), show_header=False,
                  title_justify="left")
    for key, value in memory_rows(memory):
        table.add_row(key, value)
    Console().print(table)
    return 0


def _validate(args: argparse.Namespace) -> int:
    if args.world is not None and args.memory:
        return _memory(_at_world(args))  # the memory plan at that many ranks, on the job's nodes of that size
    if args.world is not None:
        return _layout_for_world(args)
    if args.memory:
        return _memory(args)
    plan = plan_from_args(args, executor=_planned_executor(args))
    if args.json:  # the plan, and what it trains under "training" (Plan.from_json reads the rest)
        from hpc_train.login.cli.training import training_summary

        print_json({**json.loads(plan.to_json()), "training": training_summary(plan).to_dict()}, sort_keys=True)
        return 0
    from rich.console import Console

    from hpc_train.login.cli.summary import print_summary

    print_summary(Console(), plan)
    print(plain(f"{args.config}: valid for site {plan.site}"))
    return 0


def _render(args: argparse.Namespace) -> int:
    """The script into ``--out`` or the run folder. ``--out`` is checked first (:func:`check_output`): a path
    that cannot take the script is refused before the run folder is made."""
    from hpc_train.login.slurm.render import render_script, write_script
    from hpc_train.run.outputs import check_output

    if args.out is not None:
        check_output(args.out, example="job.sbatch")
    plan = plan_from_args(args, executor="slurm")
    script = render_script(plan, args.template)
    if args.stdout:
        print(script.text, end="")
        return 0
    root = Path(plan.run_dir).parent
    new_root = not root.exists()  # a site's /shared/... made on a laptop: said, as every folder render makes
    run_dir = prepare_plan_folder(plan)
    out = args.out or run_dir / f"job-{script.template}.sbatch"
    write_script(script, out)
    if args.json:
        print_json({"script": str(out), "run_dir": str(run_dir), "created_run_root": str(root) if new_root else None},
                   indent=None)
    else:
        import shlex

        if new_root:
            print(plain(f"created the run root {root} (it did not exist here; the nodes must see the same path: "
                        "job.run_root, or the site's run_root)", one_line=True))
        print(plain(f"wrote {out}", one_line=True))
        print(plain(f"submit it with: sbatch {shlex.quote(str(out))}", one_line=True))
    return 0


def _submit(args: argparse.Namespace) -> int:
    from hpc_train.login.submit import run_submit

    return run_submit(args)


def _program_name() -> str:
    """``hpc_train`` when the console script runs, ``python -m hpc_train`` otherwise: usage lines say what was typed."""
    return "hpc_train" if Path(sys.argv[0]).name == "hpc_train" else "python -m hpc_train"


def _subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[command] if actions else parser


def _build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=_program_name(), description=_ABOUT)
    parser.add_argument("--version", action="version", version=f"hpc_train {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser,
                                     metavar="COMMAND")
    submit = commands.add_parser("submit", help=SUBMIT_SUMMARY, description=SUBMIT_SUMMARY)
    add_submit_arguments(submit)
    submit.set_defaults(run=_submit)
    add_run_parser(commands, _submit)
    validate = commands.add_parser("validate", help="check a job config against a site and show the plan")
    add_plan_arguments(validate)
    validate.add_argument("--json", action="store_true", help="print the plan as JSON")
    validate.add_argument("--memory", action="store_true",
                          help="print the bytes per rank of the model, gradients, optimizer and activations")
    validate.add_argument("--world", type=int, metavar="N",
                          help="only print the rank layout of the parallel sizes at N ranks (any N)")
    validate.set_defaults(run=_validate)
    render = commands.add_parser("render", help="render an sbatch script into the run folder (or stdout)")
    add_plan_arguments(render, executor=False)
    render.add_argument("--template", help="srun, torchrun or mpirun (default: the site's launcher)")
    output = render.add_mutually_exclusive_group()
    output.add_argument("--out", type=Path, help="script path (default: RUN_DIR/job-TEMPLATE.sbatch)")
    output.add_argument("--stdout", action="store_true", help="print the script; write nothing")
    render.add_argument("--json", action="store_true", help="print the written paths as JSON")
    render.set_defaults(run=_render)
    add_ckpt_parser(commands)
    add_bench_parser(commands)
    add_logs_parser(commands)
    add_status_parser(commands)
    add_cancel_parser(commands)
    add_plot_parser(commands)
    add_doctor_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the subcommand's parser, so the usage shown is the command's own
        _subcommand_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_command(lambda: args.run(args), debug=getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
