"""Render a plan through a Jinja2 sbatch template into a script a user can read and submit with sbatch."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from hpc_train import __version__
from hpc_train.config.plan import Plan
from hpc_train.errors import ConfigError, did_you_mean
from hpc_train.fabric.nccl import detected_rows
from hpc_train.login.slurm.directives import container_srun_flags, sbatch_directives
from hpc_train.resources import shipped_dir

__all__ = ["TEMPLATES", "RenderedScript", "render_script", "template_names", "write_script"]

TEMPLATES = ("srun", "torchrun", "mpirun")


@dataclass(frozen=True)
class RenderedScript:
    """A script and the template it came from."""

    template: str
    text: str


def template_names() -> list[str]:
    """Templates shipped with this installation."""
    return sorted(path.name.removesuffix(".sbatch.j2") for path in shipped_dir("sbatch_templates").glob("*.sbatch.j2"))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(shipped_dir("sbatch_templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - shell, not HTML: every value goes through the q filter
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def _container_prefix(plan: Plan) -> tuple[list[str], list[str]]:
    """(srun flags, command prefix) for the site's container runtime."""
    container = plan.container
    if container["runtime"] == "pyxis":
        return container_srun_flags(plan), []
    if container["runtime"] == "apptainer":
        prefix = ["apptainer", "exec"]
        if plan.resources.gpus_per_node:
            prefix.append("--nv")
        for mount in container["mounts"]:
            prefix += ["--bind", mount]
        return [], [*prefix, container["image"]]
    return [], []


def render_script(plan: Plan, template: str | None = None) -> RenderedScript:
    """Render ``template`` (default: the site's launcher) for ``plan``."""
    name = template or plan.launcher
    names = template_names()
    if name not in names:
        hint = did_you_mean(name, names)
        raise ConfigError("--template", f'no template "{name}"' + (f", {hint}" if hint else ""),
                          f"use one of {', '.join(names)}")
    if plan.survives_lost_node and name != "srun":
        key = "job.spare_nodes" if plan.resources.spare_nodes else "retry.shrink"
        raise ConfigError("--template", f"{name} with {key}: only the srun template starts the agents that go on "
                          "without a lost node", "use --template srun")
    if name == "mpirun" and plan.container["runtime"] == "pyxis":
        raise ConfigError("--template", "mpirun cannot start ranks inside pyxis containers",
                          "use the srun or torchrun template on this site")
    srun_flags, prefix = _container_prefix(plan)
    low, high = plan.port_range
    text = _environment().get_template(f"{name}.sbatch.j2").render(
        version=__version__,
        template=name,
        plan=plan,
        directives=sbatch_directives(plan, name),
        env=sorted(plan.env.items()),
        detected=detected_rows(plan.nccl_detect, plan.interconnect),
        srun_flags=[*plan.srun_args, *srun_flags],
        command=[*prefix, plan.python, "-u"],
        port_low=low,
        port_span=high - low,
    )
    return RenderedScript(template=name, text=text)


def write_script(script: RenderedScript, path: Path) -> None:
    """Write the script through the one writer of outputs (:mod:`hpc_train.run.outputs`): checked (never a
    link, a FIFO, a device or a folder; its folder must exist), written beside it and renamed into place,
    executable and readable by its owner only."""
    from hpc_train.run.outputs import check_output, write_output

    check_output(path, example="job.sbatch")
    try:
        write_output(path, script.text, mode=0o700)
    except OSError as error:
        raise ConfigError("--out", f"cannot write {path} ({error.strerror or error})",
                          "give a path in a folder you can write to") from None
