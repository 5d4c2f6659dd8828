"""``hpc_train.Executor``: submitit's shape over hpc_train's plan, for notebooks and sweep scripts.

``Executor(nodes=2, tasks_per_node=4).submit(fn, *args).result()`` runs ``fn(*args)`` on every rank of a job and
returns rank 0's return value. It is the command line's path with a Python face: the same config (a job file, or
none), site, ``--set`` overrides and validation, the same run folder, submission, preemption, requeue and
follower; only the program is the submitted function, pickled into the run folder (:mod:`hpc_train.run.pickled`).
Importable on a login node: nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from hpc_train.config.checks import as_slurm_name
from hpc_train.config.job import JobSection
from hpc_train.config.plan import Plan, load_job, make_plan
from hpc_train.config.program import API_PROGRAM
from hpc_train.config.sites import load_site
from hpc_train.errors import ConfigError, did_you_mean
from hpc_train.login.api.job import Job
from hpc_train.run.pickled import Call, write_call

__all__ = ["EXECUTORS", "Executor"]

EXECUTORS = ("auto", "slurm", "local")
JOB_KEYS = tuple(f.name for f in fields(JobSection) if f.name != "program")  # the program is the function


def _toml_value(key: str, value: Any) -> str:
    """A Python value as ``--set`` reads it (typed like the file): a string as it is, others as TOML."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple) and all(isinstance(item, str | int | float) for item in value):
        return json.dumps(list(value))
    raise ConfigError(f"job.{key}", f"{value!r} is a {type(value).__name__}", "give a string, a number, a bool or "
                      "a list of strings, as the [job] table of a job file would")


def job_overrides(job_keys: Mapping[str, Any]) -> list[str]:
    """``nodes=2`` as ``job.nodes=2``; a key ``[job]`` does not have is refused, naming the nearest and all."""
    overrides = []
    for key, value in job_keys.items():
        if key == "program":
            raise ConfigError("Executor(program=...)", "the program of a submission is the function given to "
                              "submit", "pass the function: executor.submit(fn, *args); a job file's program "
                              "runs with python -m hpc_train.submit")
        if key not in JOB_KEYS:
            hint = did_you_mean(key, JOB_KEYS)
            raise ConfigError(f"Executor({key}=...)", f'"{key}" is not a key of [job]' + (f", {hint}" if hint else ""),
                              f"keys: {', '.join(JOB_KEYS)}; other sections through sets=(\"train.lr=1e-3\",)")
        overrides.append(f"job.{key}={_toml_value(key, value)}")
    return overrides


def _default_name(function: Callable[..., Any]) -> str:
    """A new run folder per submission, as submitit gives each job its own: the function's name, the time and a
    few random letters (``train-20261205-141502-3fa9``). Give ``name=`` to resume a run instead."""
    base = as_slurm_name(re.sub(r"[<>]", "", getattr(function, "__name__", "") or ""), "function", limit=40)
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class Executor:
    """Submits a function to every rank of a job; see the module note. ``config``: a job file (None: defaults);
    ``site``: a site name or file (None: ``local``); ``executor``: auto, slurm or local; ``sets``: ``--set``
    overrides of any section; ``job_keys``: keys of ``[job]`` (``nodes=2, tasks_per_node=4, time="01:00:00"``)."""

    def __init__(self, config: str | os.PathLike[str] | None = None, *, site: str | os.PathLike[str] | None = None,
                 executor: str = "auto", sets: Iterable[str] = (), **job_keys: Any) -> None:
        if executor not in EXECUTORS:
            raise ConfigError("Executor(executor=...)", f'"{executor}" is not an executor',
                              f"use one of {', '.join(EXECUTORS)}")
        if isinstance(sets, str):
            raise ConfigError("Executor(sets=...)", "is one string, not a sequence of overrides",
                              'write sets=("train.lr=1e-3",) with a trailing comma, or a list')
        self.config = Path(config) if config is not None else None
        self.site = str(site) if site is not None else "local"
        self.executor = executor
        self.sets = list(sets)
        self.job_keys = dict(job_keys)
        job_overrides(self.job_keys)  # a misspelt key is refused here, not at the first submit

    def update_parameters(self, **job_keys: Any) -> None:
        """More keys of ``[job]`` for later submissions, as submitit's ``update_parameters``."""
        job_overrides(job_keys)
        self.job_keys.update(job_keys)

    def plan(self, name: str | None = None) -> Plan:
        """The validated plan a submission would run (the function aside): what ``submit --dry-run`` shows."""
        from hpc_train.login.slurm.executors import resolve_executor

        overrides = [*self.sets, *job_overrides(self.job_keys), f"job.program={API_PROGRAM}"]
        if name is not None:
            overrides.append(f"job.name={name}")
        site = load_site(self.site)
        config = load_job(self.config, overrides)
        folder = self.config.resolve().parent if self.config is not None else Path.cwd()
        return make_plan(config, site, resolve_executor(self.executor, site.slurm.enabled), config_dir=folder)

    def _named(self) -> bool:
        """Whether the run's name was given (then a submission resumes that run, as the command line does)."""
        if "name" in self.job_keys or any(item.partition("=")[0].strip() == "job.name" for item in self.sets):
            return True
        return self.config is not None and load_job(self.config, []).job.name != JobSection().name

    def submit(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Job:
        """Run ``function(*args, **kwargs)`` on every rank (``hpc_train.context()`` inside it gives the rank's
        context); the job's result is rank 0's return value."""
        _check_callable(function)
        plan = self.plan(None if self._named() else _default_name(function))
        return self._submit([plan], [Call(function, args, kwargs)])[0]

    def map_array(self, function: Callable[..., Any], *iterables: Iterable[Any]) -> list[Job]:
        """One job per item (``function(item)``; several iterables zip, as ``map``), submitted as one job array
        (as ``submit --sweep``): the runs share resources and each has its own run folder ``NAME-000``, ..."""
        from hpc_train.login.cli.sweep import MAX_SWEEP_RUNS, sweep_name

        _check_callable(function)
        items = list(zip(*iterables, strict=True))
        if not items or len(items) > MAX_SWEEP_RUNS:
            raise ConfigError("Executor.map_array", f"{len(items)} items", f"give 1 to {MAX_SWEEP_RUNS} items")
        base = self.plan(None if self._named() else _default_name(function)).name
        plans = [self.plan(sweep_name(base, index)) for index in range(len(items))]
        return self._submit(plans, [Call(function, item, {}) for item in items])

    def _submit(self, plans: list[Plan], calls: list[Call]) -> list[Job]:
        from hpc_train.login.slurm.jobstate import check_slurm_available
        from hpc_train.login.submit import submit_plans

        if plans[0].backend.on_slurm:
            check_slurm_available()  # Job.wait() follows the job through sacct

        def write_calls(run_dirs: list[Path]) -> None:
            for run_dir, call in zip(run_dirs, calls, strict=True):
                write_call(run_dir, call)

        old = os.umask(0o077)  # submitit's folder and the ranks' files stay private
        try:
            submitted = submit_plans(plans, before_submit=write_calls)  # a local job outlives this Python
        finally:
            os.umask(old)
        return [Job(one) for one in submitted]

    def __repr__(self) -> str:
        keys = ", ".join(f"{key}={value!r}" for key, value in self.job_keys.items())
        return f"Executor({str(self.config) if self.config else None!r}, site={self.site!r}, " \
               f"executor={self.executor!r}" + (f", {keys}" if keys else "") + ")"


def _check_callable(function: Any) -> None:
    if not callable(function):
        raise ConfigError("Executor.submit", f"{function!r} is not callable", "pass the function itself: "
                          "executor.submit(train, arg), not executor.submit(train(arg))")
