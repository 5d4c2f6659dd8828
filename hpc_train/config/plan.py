"""One validated plan: a job config and a site resolved into exactly what will run.

The plan is plain data (JSON in ``run_folder/plan.json``) so the compute side reads it without pickles, and
the login side can show it, render it or hand it to submitit. Its ``config`` is the typed :class:`JobConfig`
(``plan.config.train.seq_len``), written as the plain table of its sections.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.backends import Backend, executor_backend
from hpc_train.config.checks import check_path, parse_time_seconds
from hpc_train.config.deepspeed import HIDDEN_SIZE_KEYS, check_scheduler, deepspeed_config, unfilled_auto
from hpc_train.config.ds_import import Imported, import_deepspeed_config, imported_for, merge_imported, named_in_file
from hpc_train.config.ds_semantics import check_semantics
from hpc_train.config.environment import detected_on_node, rank_env
from hpc_train.config.job import DATA_SOURCES, MODEL_PRESETS, JobConfig
from hpc_train.config.loader import build, checked_portable, load_toml, rebuild
from hpc_train.config.overrides import apply_overrides
from hpc_train.config.program import resolve_entry_point, resolve_program
from hpc_train.config.screen import screen_job, warn_redacted
from hpc_train.config.shrink import SHRUNK_NODES_ENV, ShrinkRule
from hpc_train.config.site import SiteConfig
from hpc_train.config.validate import validate
from hpc_train.errors import ConfigError

__all__ = ["Layout", "Plan", "Resources", "load_job", "make_plan", "plan_for_life", "shrunk_plan"]


@dataclass(frozen=True)
class Resources:
    """What Slurm is asked for, after site defaults."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    mem: str
    time: str
    time_seconds: int
    partition: str
    account: str
    qos: str
    constraint: str
    exclude: str
    exclusive: bool
    gpu_directive: str
    spare_nodes: int = 0  # allocated beyond nodes: hot spares (job.spare_nodes)


@dataclass(frozen=True)
class Layout:
    """Ranks and batch arithmetic: world = tensor x pipeline x data; global = micro x accum x data."""

    world: int
    tensor: int
    pipeline: int
    context: int
    data: int
    order: str
    micro_batch: int
    grad_accum: int
    global_batch: int


@dataclass(frozen=True)
class Plan:
    """Everything needed to render, submit and run one job."""

    name: str
    site: str
    executor: str
    launcher: str
    srun_args: list[str]
    run_dir: str
    python: str
    resources: Resources
    layout: Layout
    env: dict[str, str]
    forward_env: list[str]
    modules: list[str]
    container: dict[str, Any]
    signal: str
    lead_seconds: int
    requeue: bool
    max_requeues: int
    port_range: list[int]
    fabric_suffix: str
    config: JobConfig
    config_hash: str
    interconnect: str = "tcp"
    nccl_detect: list[str] = dataclasses.field(default_factory=list)  # filled in by each node (fabric.nccl)
    code_dir: str = ""  # the config file's folder: user code's relative paths, and sys.path on every rank
    prometheus_dir: str = ""  # the site's textfile-collector folder ([monitor] prometheus); empty: the run folder
    node_mtbf_hours: float = 6300.0  # the site's [reliability], for checkpoint.every_minutes = "auto"
    queue_wait_minutes: float = 30.0

    @property
    def node_agents(self) -> bool:
        """Whether a Slurm step runs one agent per node (``hpc_train.rank.agent``) that starts, watches and restarts
        that node's ranks inside the job (``retry.in_place``, spares, ``retry.shrink``), rather than one task per
        rank: the step then has one task per node with the node's CPUs."""
        return self.config.retry.in_place > 0 and self.config.job.program != "smoke"

    @property
    def backend(self) -> type[Backend]:
        """The backend ``executor`` names (:mod:`hpc_train.backends`): what differs between Slurm and the local
        executor is asked of it, never of the name."""
        return executor_backend(self.executor)

    @property
    def survives_lost_node(self) -> bool:
        """Whether the job goes on inside its allocation when a node is lost (a spare, or a smaller size): Slurm
        must not end it, and the agents on every node decide who holds the ranks (hpc_train.rank.agent.spares)."""
        return bool(self.resources.spare_nodes) or self.config.retry.shrink

    @property
    def shrink_rule(self) -> ShrinkRule | None:
        """What a smaller life keeps under ``retry.shrink``; None without it."""
        if not self.config.retry.shrink:
            return None
        lay = self.layout
        return ShrinkRule(lay.tensor * lay.pipeline * lay.context, lay.micro_batch, lay.global_batch,
                          self.resources.tasks_per_node)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["resources"].pop("shrink", None)  # held in [retry] since the rooms moved; an older plan.json has it
        data["resources"] = Resources(**data["resources"])
        data["layout"] = Layout(**data["layout"])
        data["config"] = rebuild(JobConfig, data["config"])
        return cls(**data)


def load_job(path: Path | None, overrides: list[str]) -> JobConfig:
    """Read a job file (with the ``ds_config.json`` its ``train.deepspeed_config`` names, in the file or in
    ``--set``: both are read the same way, relative to the job file's folder), apply ``--set`` overrides and
    type-check every key. Credentials are found first (:mod:`hpc_train.config.screen`), so no message after
    it can say one. Without a file (``hpc_train.Executor()``), every key is its default or an override, and
    relative paths start in the current folder."""
    data, redacted = screen_job(load_toml(path, "config") if path is not None else {})
    view, _ = screen_job(apply_overrides(data, overrides, JobConfig))  # --set names the file, or a secret
    imported = imported_for(view, path.resolve().parent if path is not None else Path.cwd())
    if imported is not None:
        data = merge_imported(data, imported, frozenset(item.partition("=")[0].strip() for item in overrides))
    data, given = screen_job(checked_portable(apply_overrides(data, overrides, JobConfig)))
    warn_redacted(redacted + given)
    if imported is not None:
        warn_redacted(imported.redacted, imported.source)
    try:
        return build(JobConfig, data)
    except ConfigError as error:
        raise named_in_file(error, imported, data) from None


def _config_hash(config: JobConfig) -> str:
    canonical = json.dumps(dataclasses.asdict(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _run_dir(cfg: JobConfig, site: SiteConfig, cwd: Path) -> str:
    root = cfg.job.run_root or site.run_root or "runs"
    path = os.path.normpath(cwd / root / cfg.job.name)
    bad = check_path(path)
    if bad:
        raise ConfigError("job.run_root", f"the run folder {bad[0]}", bad[1])
    return path


def _lead_seconds(configured: int, run_dir: str, time_seconds: int) -> int:
    """The configured lead time, raised to what this run's earlier attempts measured (three steps plus 1.5 times
    a save, ``attempts.jsonl``) when that is longer, but never past half the time limit: one slow save must not
    leave every later attempt only a sliver of its time to train."""
    from hpc_train.run.attempts import AttemptLog, recommended_lead_seconds  # it imports the run folder's writer

    measured = recommended_lead_seconds(AttemptLog(Path(run_dir)).read(warn=True), floor=configured)
    if time_seconds:
        measured = min(measured, max(configured, time_seconds // 2))
    return measured


def _exclude(configured: str, run_dir: str) -> str:
    """``job.exclude`` plus the nodes earlier attempts of this run excluded (``excluded_nodes.json``)."""
    from hpc_train.run.exclusions import exclude_expression, read_exclusions

    return exclude_expression(read_exclusions(Path(run_dir)), also=configured)


def _checked_deepspeed(cfg: JobConfig, data_parallel: int) -> None:
    """The ``[deepspeed]`` table may add keys, never change one the typed config sets, and what it adds is
    checked as a ``ds_config.json`` is (:func:`check_semantics`): DeepSpeed refuses the same things in both."""
    try:
        merged = deepspeed_config(cfg, data_parallel)
    except ValueError as error:
        where, _, problem = str(error).partition(" = ")
        raise ConfigError(where, problem.split(";")[0], "set it through its own key (zero.*, train.*) instead "
                          "of the [deepspeed] table") from None
    check_semantics(merged, "deepspeed", ".")
    check_scheduler(merged.get("scheduler"), "deepspeed.")  # a [deepspeed] table's too: DeepSpeed builds it
    left = [key for key in unfilled_auto(merged) if key.removeprefix("zero_optimization.") not in HIDDEN_SIZE_KEYS]
    if left:  # the hidden-size keys are filled on the ranks, from the model (docs/configuration.md)
        raise ConfigError(f"deepspeed.{left[0]}", '"auto" has no value to take here: the Hugging Face integration '
                          "fills the batch, clipping, optimizer and precision keys, a scheduler's warm-up and total "
                          "steps, and the ZeRO-3 sizes from the model's hidden size", "give the number")


def _absolute_data_path(cfg: JobConfig, cwd: Path) -> JobConfig:
    """Ranks run in the run folder (sbatch --chdir): a relative ``data.path`` would move."""
    if not cfg.data.path:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=os.path.normpath(cwd / cfg.data.path)))


def _absolute_program(cfg: JobConfig, config_dir: Path) -> JobConfig:
    """The files of a user program, model factory, dataset and collate function recorded absolute (relative
    paths are from the config file's folder), after checking that each, or its module, exists; nothing of
    them is imported here."""
    program = resolve_program(cfg.job.program, config_dir)
    model = resolve_entry_point("train.model", cfg.train.model, config_dir, tuple(MODEL_PRESETS))
    source = resolve_entry_point("data.source", cfg.data.source, config_dir, DATA_SOURCES)
    collate = resolve_entry_point("data.collate", cfg.data.collate, config_dir, ("",))
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, program=program),
                               train=dataclasses.replace(cfg.train, model=model),
                               data=dataclasses.replace(cfg.data, source=source, collate=collate))


def _resources(cfg: JobConfig, site: SiteConfig, gpus: int, cpus: int, run_dir: str) -> Resources:
    job = cfg.job
    return Resources(
        nodes=job.nodes, tasks_per_node=job.tasks_per_node, gpus_per_node=gpus, cpus_per_task=cpus,
        mem=job.mem or site.node.mem, time=job.time, time_seconds=parse_time_seconds(job.time) or 0,
        partition=job.partition or site.slurm.partition, account=job.account or site.slurm.account,
        qos=job.qos or site.slurm.qos, constraint=job.constraint or site.slurm.constraint,
        exclude=_exclude(job.exclude, run_dir), exclusive=site.slurm.exclusive,
        gpu_directive=site.slurm.gpu_directive, spare_nodes=job.spare_nodes,
    )


def _layout(cfg: JobConfig, data_parallel: int) -> Layout:
    job, parallel, train = cfg.job, cfg.parallel, cfg.train
    return Layout(
        world=job.nodes * job.tasks_per_node, tensor=parallel.tensor, pipeline=parallel.pipeline,
        context=parallel.context, data=data_parallel, order=parallel.order,
        micro_batch=train.micro_batch, grad_accum=train.grad_accum,
        global_batch=train.micro_batch * train.grad_accum * data_parallel,
    )


def make_plan(cfg: JobConfig, site: SiteConfig, executor: str, *, python: str | None = None,
              cwd: Path | None = None, config_dir: Path | None = None) -> Plan:
    """Resolve site defaults, run every cross-field check and return the plan.

    ``python`` is the interpreter ranks run when the site does not name one (default: this one);
    ``config_dir`` the config file's folder, where a user program's relative paths start (default: ``cwd``).
    A check's error on a key that came from the job's ``ds_config.json`` names the key in the file.
    """
    try:
        return _make_plan(cfg, site, executor, python=python, cwd=cwd, config_dir=config_dir)
    except ConfigError as error:
        imported = _imported_of(cfg, config_dir or cwd or Path.cwd())
        raise named_in_file(error, imported, dataclasses.asdict(cfg)) from None


def _imported_of(cfg: JobConfig, config_dir: Path) -> Imported | None:
    """The job's ``ds_config.json`` read again (to name its keys in a message); None without one or when it
    cannot be read now."""
    name = cfg.train.deepspeed_config
    if not name:
        return None
    try:
        return import_deepspeed_config(config_dir / name, name)
    except ConfigError:
        return None


def _make_plan(cfg: JobConfig, site: SiteConfig, executor: str, *, python: str | None,
               cwd: Path | None, config_dir: Path | None) -> Plan:
    job = cfg.job
    gpus = job.gpus_per_node if job.gpus_per_node is not None else (job.tasks_per_node if site.node.gpus else 0)
    node_cpus = site.node.cpus or os.cpu_count() or 1
    cpus = job.cpus_per_task if job.cpus_per_task is not None else max(1, node_cpus // max(1, job.tasks_per_node))
    lead = cfg.preempt.lead_seconds or site.preempt.lead_seconds
    if executor_backend(executor).on_slurm and not site.slurm.enabled:
        raise ConfigError("--executor", f"slurm, but site {site.name} has no Slurm ([slurm] enabled = false)",
                          "use --executor local, or a Slurm site")
    if job.spare_nodes and not executor_backend(executor).on_slurm:
        raise ConfigError("job.spare_nodes", f"{job.spare_nodes} spare node(s) need Slurm; the {executor} executor "
                          "runs every rank on this machine", "remove job.spare_nodes, or submit to a Slurm site")
    if cfg.retry.shrink and not executor_backend(executor).on_slurm:
        raise ConfigError("retry.shrink", f"goes on without a lost node, and the {executor} executor runs every "
                          "rank on this machine", "remove retry.shrink, or submit to a Slurm site")
    data_parallel = validate(cfg, site, gpus, cpus, lead)
    _checked_deepspeed(cfg, data_parallel)
    code_dir = Path(os.path.abspath(config_dir or cwd or Path.cwd()))
    config = _absolute_program(_absolute_data_path(cfg, Path(cwd or Path.cwd())), code_dir)
    run_dir = _run_dir(cfg, site, cwd or Path.cwd())
    lead = _lead_seconds(lead, run_dir, parse_time_seconds(job.time) or 0)
    return Plan(
        name=job.name,
        site=site.name,
        executor=executor,
        launcher=site.launch.launcher,
        srun_args=list(site.launch.srun_args),
        run_dir=run_dir,
        python=site.software.python or python or sys.executable,
        resources=_resources(cfg, site, gpus, cpus, run_dir),
        layout=_layout(cfg, data_parallel),
        env=rank_env(cfg, site, cpus, gpus, run_dir),
        forward_env=list(job.forward_env),
        modules=list(site.software.modules),
        container=dataclasses.asdict(site.container),
        signal=(cfg.preempt.signal or site.preempt.signal).upper().removeprefix("SIG"),
        lead_seconds=lead,
        requeue=cfg.preempt.requeue,
        max_requeues=cfg.preempt.max_requeues,
        port_range=list(site.launch.port_range),
        fabric_suffix=site.network.fabric_suffix,
        config=config,
        config_hash=_config_hash(config),
        interconnect=site.network.interconnect,
        prometheus_dir=site.prometheus_dir,
        node_mtbf_hours=site.reliability.node_mtbf_hours,
        queue_wait_minutes=site.reliability.queue_wait_minutes,
        nccl_detect=detected_on_node(site.network),
        code_dir=str(code_dir),
    )


def shrunk_plan(plan: Plan, nodes: int) -> Plan:
    """``plan`` for a life on ``nodes`` nodes (``retry.shrink``); a ValueError when that size cannot keep the
    layout."""
    layout, resources, rule = plan.layout, plan.resources, plan.shrink_rule
    if nodes == resources.nodes:
        return plan
    size = rule.size(nodes) if rule else None
    if size is None or size.nodes != nodes:
        raise ValueError(f"{nodes} node(s) cannot keep this job's layout (tensor {layout.tensor}, pipeline "
                         f"{layout.pipeline}, global batch {layout.global_batch})")
    config = plan.config
    train = dataclasses.replace(config.train, grad_accum=size.grad_accum)
    return dataclasses.replace(
        plan, resources=dataclasses.replace(resources, nodes=nodes),
        layout=dataclasses.replace(layout, world=size.world, data=size.data, grad_accum=size.grad_accum),
        config=dataclasses.replace(config, job=dataclasses.replace(config.job, nodes=nodes), train=train))


def plan_for_life(plan: Plan, env: dict[str, str] | os._Environ[str]) -> Plan:
    """The plan this rank runs under: the run's, or the smaller one the agents chose for this life. A
    ConfigError (one line on the rank's stderr, exit 2) when the variable came from somewhere else."""
    value = env.get(SHRUNK_NODES_ENV, "")
    if not value:
        return plan
    fix = f"unset {SHRUNK_NODES_ENV} in the job's environment; hpc_train's agent sets it for a life on fewer nodes"
    if not value.isdigit() or not plan.config.retry.shrink:
        raise ConfigError(f"{SHRUNK_NODES_ENV}={value!r}", "is set, but only hpc_train's agent sets it, to a node "
                          "count, for a job with retry.shrink", fix)
    try:
        return shrunk_plan(plan, int(value))
    except ValueError as error:
        raise ConfigError(f"{SHRUNK_NODES_ENV}={value!r}", str(error), fix) from None
