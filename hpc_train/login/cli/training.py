"""What a plan will train, said before a cluster's hours are spent: the model and its size, the data, the engine,
the number format (for ``auto``, what the nodes will pick), steps and tokens, the checkpoint cadence and where it
resumes from. Login-node code: no torch; the checkpoint folder is read, never written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.manager import CheckpointManager
from hpc_train.config.deepspeed import schedule_words
from hpc_train.config.job import MODEL_PRESETS
from hpc_train.config.plan import Plan
from hpc_train.config.program import parse_program
from hpc_train.config.young_daly import duration, estimated_cost_s, hours, plan_cadence
from hpc_train.run.paths import CHECKPOINTS_DIR

__all__ = ["TrainingSummary", "training_rows", "training_summary"]


@dataclasses.dataclass(frozen=True)
class TrainingSummary:
    """The plan's training section; ``--json`` carries it as it is (None: not known on the login node)."""

    kind: str  # "trainer", "program" or "smoke"
    from_file: dict[str, str]  # typed key -> the train.deepspeed_config key it came from (and its file)
    overridden: dict[str, Any]  # typed keys of the file that --set gave another value: the file's value
    model: dict[str, Any]
    data: dict[str, Any]
    engine: dict[str, Any]
    precision: dict[str, Any]
    steps: int | None
    tokens: int | None
    checkpoint: dict[str, Any]
    resume: dict[str, Any]
    program: dict[str, Any]
    auto: dict[str, str] = dataclasses.field(default_factory=dict)  # a ds_config.json's "auto" key -> its value

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def training_summary(plan: Plan) -> TrainingSummary:
    """The training section of ``plan``."""
    cfg = plan.config
    kind = {"train": "trainer", "smoke": "smoke"}.get(cfg.job.program, "program")
    resume = _resume_point(plan)
    checkpoint = {"every_steps": cfg.checkpoint.every_steps, "every_minutes": cfg.checkpoint.every_minutes,
                  "keep": cfg.checkpoint.keep, "async": cfg.checkpoint.async_save, "verify": cfg.checkpoint.verify,
                  "cadence": None}
    if kind == "smoke":
        return TrainingSummary(kind, {}, {}, {}, {}, {}, {}, None, None, {}, {},
                               {"entry_point": "smoke", "args": [], "params": {}})
    if kind == "program":
        script = parse_program(cfg.job.program).kind == "script"  # saves and resumes on its own, without ctx
        program = {"entry_point": cfg.job.program, "kind": "script" if script else "function",
                   "args": list(cfg.job.args), "params": dict(cfg.params)}
        return TrainingSummary(kind, {}, {}, {}, {}, {}, {}, None, None, {} if script else checkpoint,
                               {} if script else resume, program)
    steps = cfg.train.steps
    from_file, overridden, auto = _from_file(plan)
    model = _model(plan)
    checkpoint["cadence"] = _cadence(plan, model["parameters"])
    return TrainingSummary(kind, from_file, overridden, model, _data(plan), _engine(plan), _precision(plan),
                           steps,
                           steps * plan.layout.global_batch * cfg.train.seq_len, checkpoint, resume, {}, auto)


def _auto_values(plan: Plan, auto: list[str]) -> dict[str, str]:
    """What each ``"auto"`` key of the job's ds_config.json becomes, as the Hugging Face integration fills it: from
    the job's typed key, the scheduler's rule, or the model's hidden size (on the ranks for a model of yours)."""
    from hpc_train.config.deepspeed import HIDDEN_SIZE_KEYS, deepspeed_config
    from hpc_train.config.ds_import import PLAIN_KEYS

    preset = MODEL_PRESETS.get(plan.config.train.model)
    ds = deepspeed_config(plan.config, plan.layout.data, preset["hidden"] if preset else None)
    values = dataclasses.asdict(plan.config)
    shown: dict[str, str] = {}
    for key in auto:
        typed = PLAIN_KEYS.get(tuple(key.split(".")))
        node: Any = ds
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if typed is not None:
            section, field = typed.split(".")
            shown[key] = f"{values[section][field]!r} ({typed})"
        elif key.rpartition(".")[2] in HIDDEN_SIZE_KEYS and node == "auto":
            shown[key] = "from the model's hidden size, on the ranks"
        elif node is not None and node != "auto":
            shown[key] = repr(node)
        else:
            shown[key] = "from the job's keys (hpc_train builds it)"
    return shown


def _cadence(plan: Plan, parameters: int | None) -> dict[str, Any] | None:
    """``checkpoint.every_minutes`` at this size: the interval and its goodput inside the job and through the
    queue, from the save time an earlier attempt of this run measured, else a guess from the parameter count."""
    every = plan.config.checkpoint.every_minutes
    if not every:
        return None
    from hpc_train.run.attempts import AttemptLog, measured_save_s

    measured = measured_save_s(AttemptLog(Path(plan.run_dir)).read())
    if measured is None and parameters is None:
        return {"mode": every if every == "auto" else "fixed", "interval_s": None, "cost_s": None,
                "cost_measured": False}
    cost = measured if measured is not None else estimated_cost_s(parameters or 0, plan.resources.nodes,
                                                                  plan.config.checkpoint.async_save)
    return dataclasses.asdict(plan_cadence(every, cost, measured is not None, plan.node_mtbf_hours,
                                           plan.resources.nodes, plan.queue_wait_minutes))


def _from_file(plan: Plan) -> tuple[dict[str, str], dict[str, Any], dict[str, str]]:
    """Which typed keys the job's ds_config.json set, those --set changed (with the file's value), and what each
    of its ``"auto"`` values became (:func:`_auto_values`): one read of the file."""
    if not plan.config.train.deepspeed_config:
        return {}, {}, {}
    from hpc_train.config.ds_import import import_deepspeed_config

    name = plan.config.train.deepspeed_config
    imported = import_deepspeed_config(Path(plan.code_dir or ".") / name, name)
    values = dataclasses.asdict(plan.config)
    overridden = {typed: value for typed, value in imported.typed.items()
                  if values[typed.split(".")[0]][typed.split(".")[1]] != value}
    return dict(imported.origin), overridden, _auto_values(plan, imported.auto)


def _model(plan: Plan) -> dict[str, Any]:
    cfg = plan.config
    if cfg.train.model in MODEL_PRESETS:
        from hpc_train.config.memory import stage_parameters  # the GPT's shapes, without torch

        count = sum(p.numel for stage in stage_parameters(cfg.train.model, cfg.data.vocab_size, cfg.train.seq_len)
                    for p in stage)
        return {"name": cfg.train.model, "kind": "preset", "parameters": count, **MODEL_PRESETS[cfg.train.model],
                "seq_len": cfg.train.seq_len}
    return {"name": cfg.train.model, "kind": "entry point", "parameters": cfg.train.parameters or None,
            "seq_len": cfg.train.seq_len}


def _data(plan: Plan) -> dict[str, Any]:
    data = plan.config.data
    source = {"synthetic": "synthetic random tokens", "tokens": f"token file {data.path}"}.get(
        data.source, f"your dataset {data.source}")
    return {"source": data.source, "described": source, "path": data.path or None, "vocab_size": data.vocab_size,
            "num_workers": data.num_workers, "pin_memory": data.pin_memory, "collate": data.collate or None}


def _engine(plan: Plan) -> dict[str, Any]:
    cfg = plan.config
    fsdp2 = cfg.train.engine == "fsdp2"  # shards what ZeRO-3 shards; fsdp.offload moves all of it to the CPU
    return {"name": cfg.train.engine, "zero_stage": 3 if fsdp2 else cfg.zero.stage,
            "offload_optimizer": cfg.fsdp.offload if fsdp2 else cfg.zero.offload_optimizer,
            "offload_params": cfg.fsdp.offload if fsdp2 else cfg.zero.offload_params,
            "reshard_after_forward": cfg.fsdp.reshard_after_forward if fsdp2 else None,
            "optimizer": cfg.train.optimizer, "lr": cfg.train.lr,
            "schedule": schedule_words(cfg),
            "pipeline": plan.layout.pipeline, "tensor": plan.layout.tensor,
            "compile": cfg.train.compile_backend if cfg.train.compile else None}


def _precision(plan: Plan) -> dict[str, Any]:
    """``auto`` as the nodes will decide it: on the local executor the nodes are this machine, so its CPU's flags
    decide; on Slurm, GPU nodes train in bf16 where the GPU supports it, CPU nodes as their flags say."""
    requested = plan.config.train.precision
    if requested != "auto":
        return {"requested": requested, "planned": requested, "why": "train.precision"}
    from hpc_train.config.precision_rule import decide_precision, read_cpuinfo

    preset = MODEL_PRESETS.get(plan.config.train.model)
    hidden = preset["hidden"] if preset else None
    gpus = plan.resources.gpus_per_node > 0
    if not plan.backend.on_slurm and not gpus:
        planned, why = decide_precision("auto", cuda=False, cuda_bf16=False, cpuinfo=read_cpuinfo(), hidden=hidden)
        return {"requested": "auto", "planned": planned, "why": f"this machine: {why}"}
    if gpus:
        return {"requested": "auto", "planned": "bf16", "why": "the nodes have GPUs: bf16 where they support it "
                                                               "(A100, H100 and newer), else fp32"}
    return {"requested": "auto", "planned": None, "why": "CPU nodes: bf16 where their CPUs compute it natively "
                                                         "(avx512_bf16, amx_bf16) and the model is wide enough, "
                                                         "else fp32; each rank decides and all take the weakest"}


def _resume_point(plan: Plan) -> dict[str, Any]:
    """The run folder's latest verified checkpoint (sizes checked, as resume does first), or none."""
    if not plan.config.checkpoint.resume:
        return {"enabled": False, "step": None, "path": None}
    root = Path(plan.run_dir) / CHECKPOINTS_DIR
    if not root.is_dir() or root.is_symlink():
        return {"enabled": True, "step": None, "path": None}
    verified = [info for info in CheckpointManager(root, keep=1).list() if info.verified]
    best = next((info for info in verified if info.is_latest), None) or (verified[-1] if verified else None)
    return {"enabled": True, "step": best.step if best else None, "path": str(best.path) if best else None}


def _cadence_text(cadence: dict[str, Any]) -> str:
    if cadence["interval_s"] is None:
        return "decided on the ranks from the first timed save (the model's size is not known here)"
    cost = f"{cadence['cost_s']:.3g} s a save, " + ("measured by this run" if cadence["cost_measured"]
                                                  else "estimated until the run times one")
    interval = duration(cadence["interval_s"])
    if cadence["mode"] == "auto":
        interval += f" = sqrt(2 x {cadence['cost_s']:.3g} s x {hours(cadence['mtbf_s'])} between failures)"
    return (f"{interval}; {cost}; goodput {cadence['goodput_in_place']:.2%} restarting inside the job, "
            f"{cadence['goodput_requeue']:.2%} through the queue ({duration(cadence['restart_requeue_s'])} a "
            "requeue)")


def _count(value: int | None) -> str:
    if value is None:
        return "not known on the login node"
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{unit} ({value:,})"
    return f"{value:,}"


def training_rows(summary: TrainingSummary) -> list[tuple[str, str]]:
    """The summary as the plan's ``Training`` table rows."""
    rows: list[tuple[str, str]] = []
    if summary.kind == "smoke":
        rows.append(("program", "smoke: join every rank, check every group, no model"))
    elif summary.kind == "program":
        program = summary.program
        rows.append(("entry point", program["entry_point"]))
        rows.append(("args", " ".join(program["args"]) or "-"))
        rows.append(("params", ", ".join(f"{k} = {v!r}" for k, v in program["params"].items()) or "-"))
    else:
        model, engine, precision = summary.model, summary.engine, summary.precision
        shape = f", {model['layers']} layers x {model['hidden']} wide" if model["kind"] == "preset" else ""
        size = _count(model["parameters"]) if model["parameters"] else (
            "parameters not known on the login node (set train.parameters for validate --memory)")
        rows.append(("model", f"{model['name']} ({model['kind']}{shape}): {size} parameters"
                     if model["parameters"] else f"{model['name']} ({model['kind']}): {size}"))
        data = summary.data
        workers = f"{data['num_workers']} loader worker" + ("s" if data["num_workers"] != 1 else "")
        rows.append(("data", f"{data['described']}, vocabulary {data['vocab_size']:,}, {workers}"
                             + (", pinned" if data["pin_memory"] else "")))
        offload = [name for name, on in (("optimizer", engine["offload_optimizer"]),
                                         ("parameters", engine["offload_params"])) if on]
        name = ("FSDP2 (fully_shard over the data axis, DCP checkpoints)" if engine["name"] == "fsdp2"
                else f"DeepSpeed ZeRO-{engine['zero_stage']}")
        rows.append(("engine", name
                               + (f", {' and '.join(offload)} offloaded to CPU" if offload else "")
                               + f"; {engine['optimizer']} lr {engine['lr']:g}, {engine['schedule']}"
                               + (f"; each block torch.compiled ({engine['compile']})" if engine["compile"] else "")))
        planned = precision["planned"] or "decided on the nodes"
        rows.append(("precision", planned if precision["requested"] != "auto"
                     else f"auto: {planned} ({precision['why']})"))
        rows.append(("steps", f"{summary.steps:,} steps, {_count(summary.tokens)} tokens"))
    if summary.from_file:
        name = next(iter(summary.from_file.values())).split(": ")[0]
        rows.append((f"from {name}", ", ".join(sorted(summary.from_file))))
        for typed, value in sorted(summary.overridden.items()):
            rows.append(("overridden", f"{typed}: the file says {value!r}, --set gave another value"))
    if summary.auto:
        rows.append(('"auto"', ", ".join(f"{key} = {value}" for key, value in summary.auto.items())))
    if summary.checkpoint:
        ckpt = summary.checkpoint
        every = f"every {ckpt['every_steps']} steps" if ckpt["every_steps"] else "only on preemption and at the end"
        if ckpt.get("every_minutes"):
            every = (f"about every {ckpt['every_minutes']:g} min" if ckpt["every_minutes"] != "auto"
                     else "auto (Young/Daly)")
        rows.append(("checkpoints", f"{every}, keep {ckpt['keep']}, "
                                    + ("written in the background" if ckpt["async"] else "written on the step")
                                    + f", resume checks {ckpt['verify']}"))
        if ckpt.get("cadence"):
            rows.append(("cadence", _cadence_text(ckpt["cadence"])))
    resume = summary.resume
    if not resume:
        rows.append(("checkpoints", "the script's own (ctx.checkpoint is for functions)"))
        return rows
    rows.append(("resume", "off (checkpoint.resume = false): starts from the beginning" if not resume["enabled"]
                 else f"from step {resume['step']} ({resume['path']})" if resume["step"] is not None
                 else "nothing to resume: starts from the beginning"))
    return rows
