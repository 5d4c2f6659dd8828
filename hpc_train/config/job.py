"""The job configuration: one frozen dataclass per TOML section.

Defaults are chosen so that an empty file is a valid single-process job on the ``local`` site.
Cross-field rules live in :mod:`hpc_train.config.validate`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from hpc_train.config.checks import (
    check_constraint,
    check_env_name,
    check_hostlist,
    check_mem,
    check_path,
    check_signal,
    check_slurm_name,
    check_time,
)
from hpc_train.config.fields import Range, option
from hpc_train.config.params import check_params
from hpc_train.config.program import check_entry_point, check_program

__all__ = [
    "DATA_SOURCES",
    "MAX_NODES",
    "MAX_TASKS_PER_NODE",
    "MAX_WORLD",
    "MODEL_PRESETS",
    "CheckpointSection",
    "DataSection",
    "DistSection",
    "FsdpSection",
    "JobConfig",
    "JobSection",
    "MonitorSection",
    "ParallelSection",
    "PreemptSection",
    "RetrySection",
    "TrainSection",
    "WatchdogSection",
    "ZeroSection",
]

# Model presets the trainer knows: layers, heads, hidden size. Validated here so a typo fails on the login node.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "heads": 4, "hidden": 128},
    "125M": {"layers": 12, "heads": 12, "hidden": 768},
    "1.3B": {"layers": 24, "heads": 32, "hidden": 2048},
    "7B": {"layers": 32, "heads": 32, "hidden": 4096},
}
DATA_SOURCES = ("synthetic", "tokens")  # besides a dataset's entry point

# Beyond any cluster: a larger number is a typo, and would be rendered into #SBATCH lines as it is.
MAX_NODES = 100_000
MAX_TASKS_PER_NODE = 1024
MAX_WORLD = 262_144  # ranks; the largest jobs today are a tenth of it
WEEK_S = 7 * 24 * 3600  # the longest wait a timeout may name: Slurm partitions end sooner
YEAR_MIN = 365 * 24 * 60
ZERO_STAGES = Range(0, 3, "{value} is not a ZeRO stage", "{value} is not a ZeRO stage", "use 0, 1, 2 or 3")
BETA = Range(0, 1, "{value} is outside [0, 1)", "{value} is outside [0, 1)", "use a value like 0.9")


def share(example: float) -> Range:
    """A share of a step's time or of a GPU, between 0 and 1 (0 disables the check it sets)."""
    return Range(0, 1, above="{value} is above 1 (a share)",
                 fix=f"give a share of the step between 0 and 1, like {example} (0 disables the check)")


def check_model(value: str) -> tuple[str, str] | None:
    """``train.model``: a preset of the built-in GPT, or a factory's entry point (files looked for at plan time)."""
    return check_entry_point(value, tuple(MODEL_PRESETS), "a preset")


def check_source(value: str) -> tuple[str, str] | None:
    """``data.source``: a built-in source, or a dataset's entry point."""
    return check_entry_point(value, DATA_SOURCES, "a source")


_WANDB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_wandb_name(value: str) -> tuple[str, str] | None:
    """W&B project and entity names: letters, digits and . _ - (empty allowed)."""
    if not value or _WANDB_NAME.fullmatch(value):
        return None
    return (f"{value[:80]!r} is not a W&B name", "use letters, digits and . _ - only, starting with a letter or digit")


def check_collate(value: str) -> tuple[str, str] | None:
    """``data.collate``: empty (torch's default collate) or a function's entry point."""
    return check_entry_point(value, ("",))


@dataclass(frozen=True, kw_only=True)
class JobSection:
    """``[job]``: what Slurm is asked for. Empty strings mean "take the site's default"."""

    name: str = option("hpc-train", "Job and run name; the run folder is run_root/name.", check_slurm_name)
    program: str = option(
        "train", "What ranks run: train (the built-in trainer), smoke (join, check every group, no model), "
        '"package.module:function" or "path/to/file.py:function" (every rank calls function(ctx)), or '
        '"path/to/script.py" (every rank runs it as __main__, torchrun-style).', check_program)
    args: list[str] = option(list, "Arguments of a script (its sys.argv[1:]) or a function (ctx.args).",
                             factory=True)
    nodes: int = option(1, "Number of nodes.", bounds=Range(1, MAX_NODES))
    spare_nodes: int = option(0, "Hot spares: nodes allocated beyond job.nodes, idle until a node is lost; the next "
                                 "restart inside the job (retry.in_place) puts its ranks on a spare and keeps the "
                                 "layout. Slurm only, through srun (the srun template or submitit).",
                                 bounds=Range(0, MAX_NODES))
    tasks_per_node: int = option(1, "Ranks per node (one per GPU on GPU sites).", bounds=Range(1, MAX_TASKS_PER_NODE))
    gpus_per_node: int | None = option(None, "GPUs per node; default: tasks_per_node on GPU sites, 0 otherwise.",
                                       bounds=Range(0, 64))
    cpus_per_task: int | None = option(None, "CPU cores per rank; default: the node's cores / tasks_per_node.",
                                       bounds=Range(1, 4096))
    mem: str = option("", 'Memory per node ("512G", "0" for all); default: the site\'s.', check_mem)
    time: str = option("01:00:00", "Time limit, Slurm syntax (HH:MM:SS or D-HH:MM:SS).", check_time)
    partition: str = option("", "Slurm partition; default: the site's.", check_slurm_name)
    account: str = option("", "Slurm account to charge; default: the site's.", check_slurm_name)
    qos: str = option("", "Slurm quality of service; default: the site's.", check_slurm_name)
    constraint: str = option("", 'Node features ("a100&ib"); default: the site\'s.', check_constraint)
    exclude: str = option("", 'Nodes never to run on, a Slurm host list ("node[01-03]").', check_hostlist)
    run_root: str = option("", "Folder that holds run folders; default: the site's, else ./runs.", check_path)
    forward_env: list[str] = option(
        list, "Names of variables passed from the submitting shell (values never written to scripts).",
        check_env_name, factory=True,
    )


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    """``[parallel]``: model-parallel sizes. Data parallel size is derived: world / (tensor x context x pipeline)."""

    tensor: int = option(1, "Tensor-parallel size; must divide the ranks of one node.", bounds=Range(1, MAX_WORLD))
    pipeline: int = option(1, "Pipeline-parallel size (number of stages).", bounds=Range(1, MAX_WORLD))
    context: int = option(1, "Context-parallel size (sequence split across ranks).", bounds=Range(1, MAX_WORLD))
    order: str = option("tp-cp-dp-pp", "Axes from innermost (consecutive ranks) to outermost.")


@dataclass(frozen=True, kw_only=True)
class DistSection:
    """``[dist]``: how long ranks wait for each other."""

    init_timeout_s: int = option(300, "Seconds for every rank to reach rank 0 at start-up.", bounds=Range(1, WEEK_S))
    timeout_s: int = option(1800, "Seconds a collective may take before the process group gives up.",
                            bounds=Range(1, WEEK_S))


@dataclass(frozen=True, kw_only=True)
class ZeroSection:
    """``[zero]``: DeepSpeed ZeRO sharding."""

    stage: int = option(2, "ZeRO stage 0-3: 1 shards optimizer state, 2 also gradients, 3 also parameters.",
                        bounds=ZERO_STAGES)
    offload_optimizer: bool = option(False, "Keep optimizer state in CPU memory (needs DeepSpeed's CPU Adam).")
    offload_params: bool = option(False, "Keep parameters in CPU memory (ZeRO-3 only).")
    overlap_comm: bool = option(True, "Overlap gradient reduction with the backward pass.")
    bucket_size: int = option(50_000_000, "Elements per reduce / all-gather bucket.", bounds=Range(1, 10**12))


@dataclass(frozen=True, kw_only=True)
class FsdpSection:
    """``[fsdp]``: PyTorch FSDP2 (``fully_shard``), for ``train.engine = "fsdp2"``."""

    reshard_after_forward: bool = option(True, "Free each block's gathered parameters after its forward and gather "
                                         "them again for the backward (less memory, one more all-gather a block).")
    offload: bool = option(False, "Keep parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy); "
                           "the optimizer step runs on the CPU.")
    meta_init: bool = option(True, "Build the built-in GPT on the meta device, shard it, then materialise each "
                             "rank's shards (to_empty) and draw the same weights as a whole build, one parameter "
                             "at a time: no rank ever holds the whole model. With parallel.tensor > 1, or your "
                             "own model, the model is built whole first.")


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    """``[train]``: model, batch and optimizer."""

    engine: Literal["deepspeed", "fsdp2"] = option(
        "deepspeed", "What trains the model: deepspeed (ZeRO 0-3 from [zero], the pipeline engine) or fsdp2 "
        "(PyTorch's fully_shard from [fsdp], with distributed checkpoints that reshard on load).")
    deepspeed_config: str = option("", "A DeepSpeed ds_config.json (relative to this file's folder): the keys "
                                   "hpc_train models become their typed keys, the rest pass through as [deepspeed] "
                                   "does; a key the job file sets differently is refused (--set wins).",
                                   check_path)
    model: str = option("tiny", f"A preset of the built-in GPT ({', '.join(MODEL_PRESETS)}), or your model: "
                        '"package.module:factory" or "path/to/file.py:factory", factory(ctx) returning a '
                        "torch.nn.Module whose forward returns the loss.", check_model)
    parameters: int = option(0, "Parameter count of your own model, for validate --memory (0: not known on the "
                             "login node; the built-in GPT's is computed).", bounds=Range(0, 10**15))
    steps: int = option(100, "Optimizer steps to train.", bounds=Range(1, 10**12))
    seq_len: int = option(128, "Tokens per sample.", bounds=Range(1, 1 << 27))
    micro_batch: int = option(4, "Samples per rank per forward pass.", bounds=Range(1, 1 << 20))
    grad_accum: int = option(1, "Micro-batches accumulated per optimizer step.", bounds=Range(1, 1 << 20))
    global_batch: int = option(0, "Samples per step; 0 derives micro_batch x grad_accum x data, else it is checked.",
                               bounds=Range(0, 1 << 40))
    precision: Literal["auto", "bf16", "fp16", "fp32"] = option(
        "auto", "Number format: auto (decided on the nodes: bf16 on GPUs that support it and on CPUs with native "
        "bf16, else fp32), bf16, fp16 (GPU only) or fp32.")
    optimizer: Literal["torch_adamw", "fused_adam", "cpu_adam"] = option(
        "torch_adamw", "torch_adamw compiles nothing; fused_adam / cpu_adam JIT-compile DeepSpeed ops."
    )
    lr: float = option(3e-4, "Peak learning rate.",
                       bounds=Range(0, 100, "{value} is not positive", fix="use a learning rate such as 3e-4"))
    min_lr: float = option(3e-5, "Learning rate at the end of decay.", bounds=Range(0, 100))
    warmup_steps: int = option(10, "Linear warm-up steps.", bounds=Range(0, 10**12))
    decay: Literal["cosine", "linear", "constant"] = option("cosine", "Decay after warm-up.")
    weight_decay: float = option(0.1, "AdamW weight decay.", bounds=Range(0, 100))
    beta1: float = option(0.9, "AdamW beta1.", bounds=BETA)
    beta2: float = option(0.95, "AdamW beta2.", bounds=BETA)
    eps: float = option(1e-8, "AdamW epsilon.", bounds=Range(0, 1, "{value} is not positive", fix="use 1e-8"))
    grad_clip: float = option(1.0, "Clip the global gradient norm to this; 0 disables clipping.", bounds=Range(0, 1e9))
    seed: int = option(1234, "Random seed (each rank derives its own).", bounds=Range(0, 2**63 - 1))
    compile: bool = option(False, "Compile each block of the model (the GPT's transformer blocks, your model's "
                           "fsdp_blocks(), else its Hugging Face _no_split_modules or top-level children) with "
                           "torch.compile before sharding, as torchtitan does; the weights' names are unchanged, so "
                           "checkpoints and exports move between compiled and eager runs. The first steps pay the "
                           "compile (tens of seconds on a CPU with inductor). Not with zero.stage = 3 or "
                           "parallel.pipeline > 1.")
    compile_backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = option(
        "inductor", "torch.compile's backend for train.compile: inductor (generated kernels; a C++ compiler on "
        "CPUs), aot_eager (traced forward and backward, no kernels: to tell a compiler bug from yours), eager, "
        "or cudagraphs (GPUs).")


@dataclass(frozen=True, kw_only=True)
class DataSection:
    """``[data]``: where samples come from, and how they are loaded."""

    source: str = option("synthetic", 'synthetic random tokens, tokens (a uint16 token file), or your dataset: '
                         '"package.module:dataset" or "path/to/file.py:dataset", dataset(ctx, split) returning a '
                         'map-style torch Dataset for split "train" or "eval".', check_source)
    path: str = option("", "Token file for source = tokens.")
    vocab_size: int = option(256, "Vocabulary size of the built-in GPT (256 for the byte-level tokenizer).",
                             bounds=Range(2, 1 << 24))
    num_workers: int = option(0, "DataLoader worker processes per rank; 0 loads in the training process.",
                              bounds=Range(0, 1024))
    pin_memory: bool = option(False, "Page-locked batches, for faster copies to the GPU.")
    prefetch_factor: int = option(0, "Batches each worker loads ahead; 0: DataLoader's default (2). Needs workers.",
                                  bounds=Range(0, 1024))
    persistent_workers: bool = option(False, "Keep workers alive between epochs and evaluations. Needs workers.")
    collate: str = option("", 'Your batch function, "package.module:fn" or "path/to/file.py:fn"; empty: torch\'s '
                          "default collate.", check_collate)


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """``[checkpoint]``: transactional checkpoints in run_folder/checkpoints."""

    every_steps: int = option(50, "Save every N steps; 0 saves only on preemption and at the end.",
                              bounds=Range(0, 10**12))
    every_minutes: float | Literal["auto"] = option(
        0.0, 'Save about every N minutes instead of every_steps (the built-in trainer; rank 0 turns the minutes '
        'into steps from the step time it measures), or "auto": the Young/Daly interval sqrt(2 C M) from the '
        "save cost C this run measures and the job's mean time between failures M (the site's "
        "[reliability] node_mtbf_hours over the node count); 0: every_steps decides.", bounds=Range(0, YEAR_MIN))
    keep: int = option(3, "Checkpoints kept; the newest verified one is never deleted.", bounds=Range(1, 1_000_000))
    memory_every_steps: int = option(
        100, "Copy every rank's state into its node's memory every N steps (held by the node's agent, with a "
        "replica on another node's), so that a restart in place resumes from memory in seconds rather than from "
        "the shared filesystem; 0 turns it off. The built-in DeepSpeed trainer with retry.in_place >= 1, "
        "without tensor or pipeline parallelism. The copy costs about an asynchronous save's stall, so every 100 "
        "steps keeps it under 1% of the step time where a save stalls less than one step.",
        bounds=Range(0, 10**12))
    async_save: bool = option(True, "Stage files in memory and write them in the background while training "
                              "goes on (a file too big for free memory is written at once; the save before a "
                              "requeue is always synchronous).")
    verify: Literal["size", "sha256"] = option("size", "What resume checks: file sizes, or sizes and sha256.")
    resume: bool = option(True, "Resume from the latest verified checkpoint of the run folder.")


@dataclass(frozen=True, kw_only=True)
class MonitorSection:
    """``[monitor]``: progress, metrics and evaluation."""

    log_every: int = option(10, "Progress line and metrics.jsonl every N steps.", bounds=Range(1, 10**12))
    eval_every: int = option(50, "Evaluation loss every N steps; 0 disables.", bounds=Range(0, 10**12))
    histogram_every: int = option(0, "TensorBoard weight histograms every N steps; 0 disables.",
                                  bounds=Range(0, 10**12))
    tensorboard: bool = option(True, "Write TensorBoard scalars to run_folder/tensorboard.")
    health_data_share: float = option(0.3, "Flag steps that wait on data for more than this share of their time "
                                            "(a starved loader); 0 disables.", bounds=share(0.3))
    health_loss_spike: float = option(3.0, "Flag a logged loss above this many times the mean of the previous 5; "
                                           "0 disables (a NaN or infinite loss is always flagged).",
                                           bounds=Range(0, 1e9))
    health_memory_growth: float = option(0.1, "Flag memory that grew at each of the last 5 logged steps, by more "
                                              "than this fraction in all (a leak); 0 disables.", bounds=Range(0, 1e9))
    health_comm_share: float = option(0.2, "Flag steps that wait in communication compute did not hide for more "
                                           "than this share of their time (a weak fabric); 0 disables.",
                                           bounds=share(0.2))
    health_gpu_utilisation: float = option(0.7, "Flag rank 0's GPU when NVML finds it busy less than this share of "
                                                "the time (GPU nodes, the nvml extra); 0 disables.", bounds=share(0.7))
    health_gpu_memory: float = option(0.95, "Flag rank 0's GPU when its memory is fuller than this share "
                                           "(GPU nodes, the nvml extra); 0 disables.", bounds=share(0.95))
    comm_sample_every: int = option(10, "On GPUs, profile one step in this many logged steps for the exposed "
                                        "communication (CPU ranks measure every step); 0 disables.",
                                        bounds=Range(0, 10**12))
    wandb: Literal["", "offline", "online"] = option("", "Weights & Biases from rank 0: offline (under the run "
                                                         "folder, for wandb sync) or online; empty: off.")
    wandb_project: str = option("hpc_train", "The W&B project.", check_wandb_name)
    wandb_entity: str = option("", "The W&B entity (team or user); empty: your default.", check_wandb_name)
    prometheus: bool = option(False, "Write the scalars and health flags for node_exporter's textfile collector "
                                     "(the run folder, or the site's prometheus_dir).")


@dataclass(frozen=True, kw_only=True)
class PreemptSection:
    """``[preempt]``: what happens when Slurm preempts the job or its time runs out."""

    signal: str = option("", 'Signal Slurm sends before the end ("USR2"); default: the site\'s.', check_signal)
    lead_seconds: int = option(0, "Seconds before the end to send it; 0: the site's (at least 60, Slurm's slack).",
                               bounds=Range(0, WEEK_S))
    requeue: bool = option(True, "Requeue the job after a preemption or time-out save.")
    max_requeues: int = option(10, "Give up after this many requeues.", bounds=Range(0, 1_000_000))


@dataclass(frozen=True, kw_only=True)
class WatchdogSection:
    """``[watchdog]``: how long a rank may go without progress before the job fails as hung, not at the
    collective timeout or the time limit."""

    enabled: bool = option(True, "Watch every rank for hangs.")
    startup_timeout_s: int = option(1800, "From a rank's start to the end of its first step: bootstrap, model, "
                                    "resume and the first (compiling) step.", bounds=Range(10, WEEK_S))
    step_timeout_s: int = option(600, "Longest one step or one evaluation may take.", bounds=Range(10, WEEK_S))
    checkpoint_timeout_s: int = option(1800, "Longest one checkpoint save may take.", bounds=Range(10, WEEK_S))
    straggler_factor: float = option(1.5, "Name a rank whose forward pass takes this many times the median of all "
                                     "ranks in the log and metrics; 0 turns it off.", bounds=Range(0, 1e9))


@dataclass(frozen=True, kw_only=True)
class RetrySection:
    """``[retry]``: which failures requeue the job and how often (preemptions and time limits: ``[preempt]``).
    A user error (an exception in the program) and running out of memory are never retried."""

    hang: int = option(2, "Requeues after a hang the watchdog found.", bounds=Range(0, 1_000_000))
    node_failure: int = option(3, "Requeues after a node failure, each with the failed node excluded.",
                               bounds=Range(0, 1_000_000))
    infrastructure: int = option(3, "Requeues after NCCL, CUDA or network errors, with the node excluded.",
                                 bounds=Range(0, 1_000_000))
    in_place: int = option(2, "Restarts inside the same Slurm job (a new life of every rank, from the last "
                              "checkpoint) after a rank was killed, crashed, hung or met a network fault, before "
                              "the job is requeued; 0 turns them off.", bounds=Range(0, 1_000_000))
    standby: bool = option(True, "With retry.in_place: each node's agent keeps one process per rank with torch and "
                           "the rank's modules imported (started 10 s into each life), and a restart in place hands "
                           "it the rank instead of starting a new interpreter, skipping the imports (about 4 s of a "
                           "rank's start). Costs that process's memory: about 0.4 GB per rank on a CPU build. "
                           "With the trainer on DeepSpeed, a rank that saw a peer's death as an error in a "
                           "collective trains the next life in its own process (a warm restart).")
    shrink: bool = option(False, "When a node is lost and no spare is left (job.spare_nodes), go on inside the "
                          "job on the nodes left, at a smaller data-parallel size: the same global batch with "
                          "more gradient accumulation, tensor and pipeline kept, resumed from the last checkpoint "
                          "(resharded as on any other data-parallel size). Needs retry.in_place >= 1 and the srun "
                          "template; the built-in trainer only.")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole job file. ``env`` holds extra variables exported on every rank."""

    job: JobSection = option(JobSection, "", factory=True)
    parallel: ParallelSection = option(ParallelSection, "", factory=True)
    dist: DistSection = option(DistSection, "", factory=True)
    zero: ZeroSection = option(ZeroSection, "", factory=True)
    fsdp: FsdpSection = option(FsdpSection, "", factory=True)
    train: TrainSection = option(TrainSection, "", factory=True)
    data: DataSection = option(DataSection, "", factory=True)
    checkpoint: CheckpointSection = option(CheckpointSection, "", factory=True)
    monitor: MonitorSection = option(MonitorSection, "", factory=True)
    preempt: PreemptSection = option(PreemptSection, "", factory=True)
    watchdog: WatchdogSection = option(WatchdogSection, "", factory=True)
    retry: RetrySection = option(RetrySection, "", factory=True)
    env: dict[str, str] = option(dict, "Variables exported on every rank (no secrets).", check_env_name, factory=True)
    params: dict[str, Any] = option(dict, "Your program's own values (any TOML values), as ctx.params on every rank.",
                                    factory=True, table_check=check_params)
    deepspeed: dict[str, Any] = option(dict, "DeepSpeed config keys hpc_train does not model, merged into the "
                                       "engine's config; a key the typed config sets is an error.", factory=True)
