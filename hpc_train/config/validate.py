"""Cross-field checks of a job against its site: every rule that needs more than one value.

Each rule raises ConfigError naming the keys, their values and the fix. Rules run in the order a user would
fix things: resources, then layout, then training, then checkpoints and preemption.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hpc_train.common.topology import Topology
from hpc_train.config.checks import parse_time_seconds
from hpc_train.config.env_policy import refused_env_name, secret_reason
from hpc_train.config.job import MAX_WORLD, MODEL_PRESETS, FsdpSection, JobConfig, ZeroSection
from hpc_train.config.shrink import ShrinkRule
from hpc_train.config.site import SiteConfig
from hpc_train.errors import ConfigError, did_you_mean

__all__ = ["MAX_WORLD", "SLURM_SIGNAL_SLACK_S", "validate"]

# Slurm may deliver --signal up to 60 s before the requested lead time.
SLURM_SIGNAL_SLACK_S = 60


def _at_least(where: str, value: float, low: float, fix: str = "") -> None:
    if value < low:
        raise ConfigError(where, f"{value} is below the minimum {low}", fix or f"set it to {low} or more")


def _check_ranges(section: Any, where: str) -> None:
    """Every number of ``section`` in its schema's ``Range``, again: the loader checks a file's values, and this
    holds for a config built in code (``JobConfig(job=JobSection(spare_nodes=-1))``) too."""
    for item in dataclasses.fields(section):
        value, key = getattr(section, item.name), f"{where}{item.name}"
        if dataclasses.is_dataclass(value):
            _check_ranges(value, f"{key}.")
            continue
        bounds = item.metadata.get("range")
        for number in value if isinstance(value, list) else [value]:
            if bounds is not None and isinstance(number, int | float) and not isinstance(number, bool):
                bad = bounds.problem(number)
                if bad:
                    raise ConfigError(key, *bad)


def _check_counts(cfg: JobConfig) -> None:
    """Each key's own range (the schema's ``Range``), then what one key's range cannot say."""
    _check_ranges(cfg, "")
    if not cfg.job.name:
        raise ConfigError("job.name", "is empty", 'give the run a name, like name = "gpt-125m"')


def _check_env(cfg: JobConfig, site: SiteConfig) -> None:
    """[env] of the job and the site: no credentials written, nothing that runs code. job.forward_env passes
    values of the submitting shell, which are the user's own, so only sbatch's keywords are refused there."""
    for where, env in (("env", cfg.env), (f"site {site.name}: env", site.env)):
        for name, value in env.items():
            secret = secret_reason(name, value)
            if secret:
                raise ConfigError(f"{where}.{name}", f"looks like a secret ({secret}) and would be written into the "
                                  f'job script and plan', f'remove it and add "{name}" to job.forward_env, or read '
                                  "it from a 0600 file on the compute node")
            refused = refused_env_name(name)
            if refused:
                raise ConfigError(f"{where}.{name}", refused, "remove it from [env]")
    for name in cfg.job.forward_env:
        if name.upper() in ("ALL", "NONE", "NIL"):
            raise ConfigError("job.forward_env", f'"{name}" is an sbatch --export keyword, not a variable',
                              "list the names of the variables to pass, like [\"WANDB_API_KEY\"]")


def _check_resources(cfg: JobConfig, site: SiteConfig, gpus_per_node: int, cpus_per_task: int) -> None:
    job = cfg.job
    if site.node.gpus and gpus_per_node > site.node.gpus:
        raise ConfigError("job.gpus_per_node", f"{gpus_per_node} is more than the {site.node.gpus} GPUs of a "
                          f"{site.name} node", f"ask for at most {site.node.gpus} and add nodes instead")
    if not site.node.gpus and gpus_per_node:
        raise ConfigError("job.gpus_per_node", f"{gpus_per_node} GPUs asked for, but site {site.name} has none",
                          "remove job.gpus_per_node or pick a GPU site")
    if gpus_per_node and job.tasks_per_node > gpus_per_node:
        raise ConfigError("job.tasks_per_node", f"{job.tasks_per_node} ranks per node but {gpus_per_node} GPUs",
                          f"one rank per GPU: set tasks_per_node = {gpus_per_node}")
    if site.node.cpus and cpus_per_task * job.tasks_per_node > site.node.cpus:
        raise ConfigError("job.cpus_per_task", f"{cpus_per_task} x {job.tasks_per_node} tasks_per_node = "
                          f"{cpus_per_task * job.tasks_per_node} cores, but a {site.name} node has {site.node.cpus}",
                          f"set cpus_per_task to at most {max(1, site.node.cpus // job.tasks_per_node)}")
    seconds = parse_time_seconds(job.time) or 0
    limit = parse_time_seconds(site.slurm.max_time) if site.slurm.max_time else None
    if limit is not None and seconds > limit:
        raise ConfigError("job.time", f'"{job.time}" is longer than the {site.name} limit "{site.slurm.max_time}"',
                          "shorten it; preemption and requeue carry the run on from its checkpoint")
    _check_env(cfg, site)
    if site.container.runtime != "none" and not site.container.image:
        raise ConfigError(f"site {site.name}: container.image", f"is empty but runtime is {site.container.runtime}",
                          "set the image, or runtime = \"none\"")
    if site.container.runtime == "pyxis" and not site.software.python:
        raise ConfigError(f"site {site.name}: software.python", "is empty, but ranks run inside a pyxis container "
                          "where the submitting interpreter does not exist", 'set it, like "/usr/bin/python3"')
    low, high = [*site.launch.port_range, 0, 0][:2]
    if len(site.launch.port_range) != 2 or not 1024 <= low < high <= 65536:
        raise ConfigError(f"site {site.name}: launch.port_range", f"{site.launch.port_range} is not [low, high)",
                          "use two ports with 1024 <= low < high <= 65536, like [20000, 32768]")


def _check_layout(cfg: JobConfig, gpus_per_node: int) -> int:
    job, par = cfg.job, cfg.parallel
    world = job.nodes * job.tasks_per_node
    if world > MAX_WORLD:
        raise ConfigError("job.nodes", f"{job.nodes} nodes x {job.tasks_per_node} tasks_per_node = {world:,} ranks, "
                          f"above the maximum {MAX_WORLD:,}", "ask for fewer nodes")
    model_parallel = par.tensor * par.pipeline * par.context
    if world % model_parallel:
        sizes = f"tensor x pipeline = {par.tensor} x {par.pipeline}" if par.context == 1 else (
            f"tensor x context x pipeline = {par.tensor} x {par.context} x {par.pipeline}")
        raise ConfigError("parallel", f"world size {world} (= {job.nodes} nodes x {job.tasks_per_node} "
                          f"tasks_per_node) is not divisible by {sizes}",
                          f"make nodes x tasks_per_node a multiple of {model_parallel}, or change the sizes")
    try:
        Topology.build(world, tp=par.tensor, pp=par.pipeline, cp=par.context, order=par.order)
    except ValueError as error:
        raise ConfigError("parallel.order" if "order" in str(error) else "parallel", str(error)) from None
    if job.tasks_per_node % par.tensor:
        raise ConfigError("parallel.tensor", f"{par.tensor} does not divide the {job.tasks_per_node} ranks of a node",
                          "a tensor group must stay inside one node: pick a divisor of tasks_per_node")
    _check_model_shape(cfg)
    zero = cfg.zero
    if zero.stage not in (0, 1, 2, 3):
        raise ConfigError("zero.stage", f"{zero.stage} is not a ZeRO stage", "use 0, 1, 2 or 3")
    if zero.stage >= 2 and par.pipeline > 1:
        raise ConfigError("zero.stage", f"ZeRO-{zero.stage} cannot run with pipeline = {par.pipeline} "
                          "(DeepSpeed refuses it)", "use zero.stage = 0 or 1 with pipeline parallelism")
    if zero.offload_params and zero.stage != 3:
        raise ConfigError("zero.offload_params", f"needs ZeRO-3, stage is {zero.stage}", "set zero.stage = 3")
    if zero.offload_optimizer and cfg.train.optimizer != "cpu_adam":
        raise ConfigError("zero.offload_optimizer", f'needs train.optimizer = "cpu_adam", got '
                          f'"{cfg.train.optimizer}"', 'set train.optimizer = "cpu_adam" (it JIT-compiles once)')
    if zero.offload_optimizer and zero.stage == 0:
        raise ConfigError("zero.offload_optimizer", "needs ZeRO stage 1-3, stage is 0", "set zero.stage = 1 or more")
    if cfg.train.seq_len % par.context:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} is not divisible by context = {par.context}",
                          "make seq_len a multiple of the context-parallel size")
    if cfg.job.program == "train" and par.pipeline > 1 and par.order != "tp-cp-dp-pp":
        raise ConfigError("parallel.order", f'"{par.order}": DeepSpeed\'s pipeline engine lays ranks out as '
                          "tensor, data, pipeline from the innermost", 'use order = "tp-cp-dp-pp" with pipelines')
    if cfg.job.program == "train" and par.context > 1:
        raise ConfigError("parallel.context", f"{par.context}: context-parallel training is not built yet",
                          'train with context = 1, or check the layout with job.program = "smoke"')
    if cfg.train.precision == "fp16" and not gpus_per_node:  # only an explicit fp16: auto never picks it
        raise ConfigError("train.precision", '"fp16" needs a GPU and this job has none',
                          'use "bf16" or "fp32" on CPUs')
    return world // model_parallel


def _check_model_shape(cfg: JobConfig) -> None:
    """The built-in GPT's shape against the layout; a user model's shape is its own (checked on the ranks)."""
    par = cfg.parallel
    preset = MODEL_PRESETS.get(cfg.train.model)
    if preset is None:
        if ":" in cfg.train.model:
            return
        hint = did_you_mean(cfg.train.model, MODEL_PRESETS)
        raise ConfigError("train.model", f'"{cfg.train.model}" is not a preset' + (f", {hint}" if hint else ""),
                          f'use one of {", ".join(MODEL_PRESETS)}, or your factory: "path/to/file.py:factory"')
    if preset["heads"] % par.tensor:
        raise ConfigError("parallel.tensor", f"{par.tensor} does not divide the {preset['heads']} attention heads "
                          f"of model {cfg.train.model}", "pick a tensor size that divides the head count")
    if cfg.data.vocab_size % par.tensor:
        raise ConfigError("data.vocab_size", f"{cfg.data.vocab_size} is not divisible by tensor = {par.tensor}",
                          "pad the vocabulary to a multiple of the tensor size")
    if par.pipeline > preset["layers"]:
        raise ConfigError("parallel.pipeline", f"{par.pipeline} stages for the {preset['layers']} layers of model "
                          f"{cfg.train.model}", f"use at most {preset['layers']} stages")


def _check_loader(cfg: JobConfig) -> None:
    """DataLoader settings that torch would refuse on every rank, refused here once."""
    data = cfg.data
    _at_least("data.num_workers", data.num_workers, 0, "use 0 (load in the training process) or more workers")
    _at_least("data.prefetch_factor", data.prefetch_factor, 0, "use 0 (the default) or a small count such as 2")
    if not data.num_workers:
        for key, value in (("prefetch_factor", data.prefetch_factor), ("persistent_workers", data.persistent_workers)):
            if value:
                raise ConfigError(f"data.{key}", f"{value} needs worker processes, but data.num_workers = 0",
                                  f"set data.num_workers to 1 or more, or leave data.{key} unset")
    _at_least("train.parameters", cfg.train.parameters, 0, "give your model's parameter count, or 0")


def _check_training(cfg: JobConfig, data_parallel: int) -> None:
    train = cfg.train
    derived = train.micro_batch * train.grad_accum * data_parallel
    if train.global_batch and train.global_batch != derived:
        raise ConfigError("train.global_batch", f"{train.global_batch} != micro_batch x grad_accum x data = "
                          f"{train.micro_batch} x {train.grad_accum} x {data_parallel} = {derived}",
                          f"set global_batch = {derived} or 0, or change micro_batch/grad_accum")
    if train.lr <= 0:
        raise ConfigError("train.lr", f"{train.lr} is not positive", "use a learning rate such as 3e-4")
    if train.min_lr > train.lr:
        raise ConfigError("train.min_lr", f"{train.min_lr} is above lr = {train.lr}", "make min_lr <= lr")
    if train.warmup_steps > train.steps:
        raise ConfigError("train.warmup_steps", f"{train.warmup_steps} is more than steps = {train.steps}",
                          "make warmup_steps <= steps")
    for where, beta in (("train.beta1", train.beta1), ("train.beta2", train.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(where, f"{beta} is outside [0, 1)", "use a value like 0.9")
    if train.eps <= 0:
        raise ConfigError("train.eps", f"{train.eps} is not positive", "use 1e-8")
    _check_loader(cfg)
    if cfg.data.source == "tokens" and not cfg.data.path:
        raise ConfigError("data.path", 'is empty but data.source = "tokens"', "give the token file's path")
    if cfg.data.source == "tokens" and cfg.data.vocab_size > 65536:
        raise ConfigError("data.vocab_size", f"{cfg.data.vocab_size} does not fit a uint16 token file",
                          "use at most 65536")


def _check_preempt(cfg: JobConfig, site: SiteConfig, lead_seconds: int) -> None:
    if lead_seconds < SLURM_SIGNAL_SLACK_S:
        where = "preempt.lead_seconds" if cfg.preempt.lead_seconds else f"site {site.name}: preempt.lead_seconds"
        raise ConfigError(where, f"{lead_seconds} s is less than Slurm's {SLURM_SIGNAL_SLACK_S} s delivery slack",
                          f"use at least {SLURM_SIGNAL_SLACK_S}")
    seconds = parse_time_seconds(cfg.job.time) or 0
    if lead_seconds >= seconds:
        raise ConfigError("preempt.lead_seconds", f"{lead_seconds} s is not shorter than job.time "
                          f'"{cfg.job.time}"', "give the job more time or a shorter lead")


def _check_cadence(cfg: JobConfig, site: SiteConfig) -> None:
    """``checkpoint.every_minutes`` is the built-in trainer's; "auto" needs a failure rate to work from."""
    every = cfg.checkpoint.every_minutes
    if every == 0:
        return
    if every != "auto":
        _at_least("checkpoint.every_minutes", every, 0, 'give minutes (like 30), "auto", or 0 to save by steps')
    if cfg.job.program != "train":
        raise ConfigError("checkpoint.every_minutes", f"is the built-in trainer's; job.program = "
                          f'"{cfg.job.program}" saves when it calls ctx.checkpoint.save',
                          "remove it, and save from your program at the cadence you choose")
    reliability = site.reliability
    if every == "auto" and reliability.node_mtbf_hours <= 0:
        raise ConfigError(f"site {site.name}: reliability.node_mtbf_hours", f"{reliability.node_mtbf_hours} "
                          'leaves checkpoint.every_minutes = "auto" no failure rate to work from',
                          "give one node's mean time between failures in hours (6300 is Llama 3's)")
    if reliability.queue_wait_minutes < 0:
        raise ConfigError(f"site {site.name}: reliability.queue_wait_minutes",
                          f"{reliability.queue_wait_minutes} is below 0", "give the typical wait in minutes")


def _check_spares(cfg: JobConfig, site: SiteConfig) -> None:
    """A spare takes over inside the job: only the agents srun starts can hand ranks to it."""
    if not cfg.job.spare_nodes:
        return
    if cfg.retry.in_place < 1:
        raise ConfigError("job.spare_nodes", f"{cfg.job.spare_nodes} with retry.in_place = 0: a spare is used by a "
                          "restart inside the job", "set retry.in_place to 1 or more, or remove job.spare_nodes")
    if site.launch.launcher != "srun":
        raise ConfigError("job.spare_nodes", f"needs the srun launcher; site {site.name} launches with "
                          f"{site.launch.launcher}, whose ranks have no agent to move them",
                          "use a site with [launch] launcher = \"srun\" and the srun template, or remove "
                          "job.spare_nodes")
    if cfg.job.program == "smoke":
        raise ConfigError("job.spare_nodes", "the smoke program restarts nothing", "remove job.spare_nodes")


def _check_shrink(cfg: JobConfig, site: SiteConfig) -> None:
    """A smaller size inside the job: the agents decide it, and the built-in trainer resumes at any
    data-parallel size (a program of your own may not expect another world size)."""
    if not cfg.retry.shrink:
        return
    if cfg.retry.in_place < 1:
        raise ConfigError("retry.shrink", "with retry.in_place = 0: the smaller size is a restart inside the job",
                          "set retry.in_place to 1 or more, or remove retry.shrink")
    if site.launch.launcher != "srun":
        raise ConfigError("retry.shrink", f"needs the srun launcher; site {site.name} launches with "
                          f"{site.launch.launcher}, whose ranks have no agent to restart them",
                          "use a site with [launch] launcher = \"srun\" and the srun template, or remove retry.shrink")
    if cfg.job.program != "train":
        raise ConfigError("retry.shrink", f'is the built-in trainer\'s, and job.program = "{cfg.job.program}": a '
                          "program of your own would start again at a world size it did not plan for",
                          "remove retry.shrink; job.spare_nodes keeps the size")
    if cfg.job.nodes < 2:
        raise ConfigError("retry.shrink", "with job.nodes = 1: there is no smaller number of nodes to go on with",
                          "remove retry.shrink, or use job.spare_nodes")
    par, train = cfg.parallel, cfg.train
    per_node, model_parallel = cfg.job.tasks_per_node, par.tensor * par.pipeline * par.context
    global_batch = train.micro_batch * train.grad_accum * (cfg.job.nodes * per_node // model_parallel)
    if ShrinkRule(model_parallel, train.micro_batch, global_batch, per_node).size(cfg.job.nodes - 1) is None:
        raise ConfigError("retry.shrink", f"no smaller number of nodes keeps tensor x pipeline x context = "
                          f"{model_parallel} and the global batch of {global_batch} (micro batch "
                          f"{train.micro_batch})", "use job.spare_nodes, or a global batch that more "
                          "data-parallel sizes divide")


def _check_network(site: SiteConfig) -> None:
    """Numbers NCCL takes only within a range; outside it NCCL ignores or rejects them at the first collective."""
    network = site.network
    for key, value, low, high in (("ib_timeout", network.ib_timeout, 1, 31),
                                  ("ib_retry_cnt", network.ib_retry_cnt, 0, 7),
                                  ("flight_recorder", network.flight_recorder, 0, 1_000_000)):
        if not low <= value <= high:
            raise ConfigError(f"site {site.name}: network.{key}", f"{value} is outside {low}..{high}",
                              f"use a value from {low} to {high}")


def _changed(section: Any, defaults: Any) -> list[str]:
    """The fields of ``section`` set to something other than their defaults."""
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(defaults, f.name)]


def _check_engine(cfg: JobConfig) -> None:
    """Each engine's keys only with that engine: a key the chosen engine would ignore is refused, so nothing a
    user set is silently dropped."""
    if cfg.train.engine == "deepspeed":
        for name in _changed(cfg.fsdp, FsdpSection()):
            raise ConfigError(f"fsdp.{name}", 'is for train.engine = "fsdp2"; this job trains with DeepSpeed',
                              f'set train.engine = "fsdp2", or remove fsdp.{name}')
        return
    for name in _changed(cfg.zero, ZeroSection()):
        raise ConfigError(f"zero.{name}", 'is DeepSpeed\'s; train.engine = "fsdp2" shards parameters, gradients and '
                          "optimizer state by itself (ZeRO-3's layout)",
                          f'remove zero.{name} (offload is fsdp.offload), or set train.engine = "deepspeed"')
    for key in cfg.deepspeed:
        raise ConfigError(f"deepspeed.{key}", 'is a DeepSpeed config key; train.engine = "fsdp2" does not read it',
                          'remove the [deepspeed] table, or set train.engine = "deepspeed"')
    for axis in ("pipeline", "context"):
        size = getattr(cfg.parallel, axis)
        if size > 1:
            raise ConfigError(f"parallel.{axis}", f'{size} with train.engine = "fsdp2": FSDP2 here shards over the '
                              f"data axis, with tensor parallelism beside it ({axis} parallelism trains with "
                              "DeepSpeed)", f'set parallel.{axis} = 1, or train.engine = "deepspeed"')
    if cfg.train.optimizer != "torch_adamw":
        raise ConfigError("train.optimizer", f'"{cfg.train.optimizer}" is a DeepSpeed op; FSDP2 trains with '
                          "torch's AdamW on the sharded parameters", 'use train.optimizer = "torch_adamw"')
    if cfg.train.precision == "fp16":
        raise ConfigError("train.precision", 'fp16 needs a loss scaler, which train.engine = "fsdp2" does not have '
                          "here", 'use "bf16" (or "fp32", or "auto")')


def _check_compile(cfg: JobConfig) -> None:
    """``train.compile`` where compiling each block is right: not under DeepSpeed's ZeRO-3, whose hooks gather
    each parameter inside the block's forward, nor its pipeline engine, which runs the layers itself."""
    train = cfg.train
    if not train.compile:
        if train.compile_backend != "inductor":
            raise ConfigError("train.compile_backend", f'"{train.compile_backend}" is set but train.compile is '
                              "false, so nothing is compiled", "set train.compile = true, or remove the backend")
        return
    if cfg.job.program != "train":
        raise ConfigError("train.compile", f'is the built-in trainer\'s, and job.program = "{cfg.job.program}"',
                          "remove it; a program of your own calls model.compile() (or torch.compile) itself")
    if train.engine == "deepspeed" and cfg.zero.stage == 3:
        raise ConfigError("train.compile", "with zero.stage = 3: ZeRO-3 gathers each parameter in hooks inside the "
                          "compiled blocks", 'use train.engine = "fsdp2" (its shards compile), or zero.stage <= 2')
    if cfg.parallel.pipeline > 1:
        raise ConfigError("train.compile", f"with parallel.pipeline = {cfg.parallel.pipeline}: DeepSpeed's "
                          "pipeline engine runs the layers itself", "set parallel.pipeline = 1, or train.compile "
                          "= false")


def validate(cfg: JobConfig, site: SiteConfig, gpus_per_node: int, cpus_per_task: int, lead_seconds: int) -> int:
    """Run every cross-field rule; return the derived data-parallel size."""
    _check_counts(cfg)
    _check_engine(cfg)
    _check_compile(cfg)
    _check_resources(cfg, site, gpus_per_node, cpus_per_task)
    data_parallel = _check_layout(cfg, gpus_per_node)
    _check_training(cfg, data_parallel)
    _check_preempt(cfg, site, lead_seconds)
    _check_cadence(cfg, site)
    _check_spares(cfg, site)
    _check_shrink(cfg, site)
    _check_network(site)
    return data_parallel
