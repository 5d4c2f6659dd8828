"""The training loop every rank runs: bootstrap, groups, model, DeepSpeed engine, data, and rank-0 monitoring.

Kept to the loop itself, in stages a reader can name: set up (bootstrap, groups, precision), build (model,
engine, data, checkpointer), resume, the steps (each may stop the run on a preemption signal), finish. The model
comes from its :class:`~hpc_train.rank.train.models.ModelSpec`; nothing here knows it is a GPT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from hpc_train.common.topology import Topology
from hpc_train.config.job import MODEL_PRESETS
from hpc_train.config.plan import Plan
from hpc_train.failures.policy import RetryPolicy
from hpc_train.rank.distributed.bootstrap import bootstrap, shutdown
from hpc_train.rank.distributed.collectives import all_reduce_values
from hpc_train.rank.distributed.context import RankContext
from hpc_train.rank.distributed.faults import (
    injected_comm_delay_s,
    injected_delay_s,
    injected_leak_bytes,
    maybe_inject_fault,
)
from hpc_train.rank.distributed.launchers import LaunchInfo
from hpc_train.rank.distributed.mesh import ParallelGroups
from hpc_train.rank.runtime.entry_points import UserCodeError
from hpc_train.rank.runtime.exporters import build_exporters
from hpc_train.rank.runtime.flops import peak_flops
from hpc_train.rank.runtime.health import HealthCheck, Thresholds
from hpc_train.rank.runtime.heap import freeze_set_up
from hpc_train.rank.runtime.monitor import LogLines, Monitor
from hpc_train.rank.runtime.nvml import GpuReadings
from hpc_train.rank.runtime.preemption import PreemptionWatch, arm_force_exit
from hpc_train.rank.runtime.stopping import AttemptRecorder, decide_hang, signal_name
from hpc_train.rank.runtime.watchdog import Timeouts, Watchdog
from hpc_train.rank.train.breakdown import StepBreakdown
from hpc_train.rank.train.comm_clock import CollectiveClock
from hpc_train.rank.train.engines import EngineCheckpoints, Stepping, engine_kind
from hpc_train.rank.train.forward import forward_loss
from hpc_train.rank.train.loader import BatchStream
from hpc_train.rank.train.model_card import write_model_card
from hpc_train.rank.train.models import ModelSpec, model_spec
from hpc_train.rank.train.precision import agreed_precision
from hpc_train.rank.train.rank_data import RankData, build_data
from hpc_train.rank.train.relife import end_life, mark_released
from hpc_train.rank.train.stragglers import StragglerCheck
from hpc_train.run.loglines import format_saved_after_signal
from hpc_train.run.stops import attempt_key

__all__ = ["train"]

# In a hang that other ranks caused, how long a rank that may restart warm waits for its collective to fail once
# they leave (their exit closes the connections it waits on: milliseconds, then the release of the life)
WARM_HANG_WAIT_S = 10.0


def _memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mean_over(value: float, group: Any) -> float:
    return float(all_reduce_values([value], group=group)[0]) / dist.get_world_size(group)


def _evaluate(engine: Any, data: RankData, groups: ParallelGroups, watch: PreemptionWatch | None, said: str,
              batches: int = 4) -> float | None:
    """Loss on a fixed set of batches (the same at every evaluation), averaged over data-parallel ranks; None
    when a preemption signal cut it short (the ranks agree on that between batches; not with ``watch`` None,
    the evaluation after the last step, which a signal no longer stops), or when there is no evaluation set."""
    stream = data.eval_stream()
    if stream is None:
        return None
    if groups.size("pp") > 1:
        from hpc_train.rank.train.pipeline import eval_step  # DeepSpeed's pipeline engine: imported when it is used

        return eval_step(engine, stream, micro_batches=batches)
    engine.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for _ in range(batches):
                if watch is not None and watch.agreed():
                    return None
                total += float(forward_loss(engine, next(stream), said))
    finally:
        engine.train()
        stream.close()
    return _mean_over(total / batches, groups.group("dp"))


@dataclass
class _Rank:
    """What this rank was given, and the attempt once it is open (the watchdog's hang decision reads it).
    ``plan`` is replaced by the set-up stage with the precision resolved."""

    plan: Plan
    info: LaunchInfo
    run_dir: Path
    log: Callable[[str], None]
    watch: PreemptionWatch
    warm: bool = False  # this process may train the next life itself (rank/entry.py)
    watchdog: Watchdog | None = None
    recorder: AttemptRecorder | None = None


@dataclass
class _Parts:
    """The run's built parts (the build stage), which every later stage uses."""

    groups: ParallelGroups
    pipelined: bool
    model: Any
    engine: Stepping
    data: RankData
    checkpointer: EngineCheckpoints
    stragglers: StragglerCheck
    flops_per_token: float
    said: str  # the model, as messages name it
    breakdown: StepBreakdown  # where each step's time goes (data, forward, backward, optimizer)
    health: HealthCheck  # rank 0's verdicts on the logged steps (health.json)
    gpu: GpuReadings | None = None  # rank 0's GPU through NVML, for the health checks (GPU ranks only)
    leaked: list[Any] = dataclasses.field(default_factory=list)  # HPC_TRAIN_INJECT_FAULT=leak:R:MB keeps these

    @property
    def stream(self) -> BatchStream:
        return self.data.train


@dataclass
class _Progress:
    """Where the loop is: the step it is at and the last losses."""

    start_step: int
    step: int
    loss: float = float("nan")
    eval_loss: float = float("nan")


def _resolve_precision(plan: Plan, backend: str, log: Callable[[str], None]) -> Plan:
    """``plan`` with ``train.precision`` decided on this hardware (``"auto"``), the same on every rank."""
    requested = plan.config.train.precision
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    preset = MODEL_PRESETS.get(plan.config.train.model)  # a user's model: its width is unknown until it is built
    precision, reason = agreed_precision(requested, device, preset["hidden"] if preset else None)
    log(f"precision: {requested} -> {precision} ({reason})" if requested == "auto" else f"precision: {precision}")
    config = dataclasses.replace(plan.config, train=dataclasses.replace(plan.config.train, precision=precision))
    return dataclasses.replace(plan, config=config)


def _progress(watchdog: Watchdog | None, phase: str, step: int) -> None:
    if watchdog is not None:
        watchdog.enter(phase, step)


def _stop(rank: _Rank, parts: _Parts, recorder: AttemptRecorder, step: int, signum: int) -> dict[str, Any]:
    """All ranks agreed on a preemption signal after ``step``: save it (a force-exit timer guards the save), let
    rank 0 record the attempt and requeue, and return how this rank must exit."""
    plan, info, log, watch = rank.plan, rank.info, rank.log, rank.watch
    name = signal_name(signum)
    received = watch.received_at or time.time()
    budget = max(10.0, plan.lead_seconds - (time.time() - received) - 5)
    log(f"{name} received: saving step {step}, then stopping (the save must finish within {budget:.0f} s)")
    parts.stream.close()  # the workers leave before a requeue's SIGTERM reaches them
    timer = arm_force_exit(budget, log)
    _progress(rank.watchdog, "checkpoint", step)
    try:
        saved = time.perf_counter()
        parts.checkpointer.save(parts.engine, step, parts.stream.state_dict(), wait=True)  # durable first
        recorder.save_time(time.perf_counter() - saved)
        preempt = plan.config.preempt
        requeue = recorder.stopped(step, signum, name == f"SIG{plan.signal}", preempt.requeue,
                                   preempt.max_requeues)
    finally:
        timer.cancel()
    log(format_saved_after_signal(step, time.time() - received, name, requeue.action != "none", requeue.reason))
    shutdown()
    return {"rank": info.rank, "steps": plan.config.train.steps, "stopped": {
        "signal": name, "step": step, "requeue": requeue.action, "exit_code": requeue.exit_code,
        "reason": requeue.reason}, "world_size": info.world_size, "launcher": info.launcher}


def train(plan: Plan, info: LaunchInfo, run_dir: Path, log: Callable[[str], None] = print,
          watch: PreemptionWatch | None = None, warm: bool = False) -> dict[str, Any]:
    """Train ``plan`` on this rank; ``log`` takes rank 0's progress lines. Returns this rank's summary.

    ``watch`` should be installed as the rank starts (``hpc_train.rank.entry`` does): a signal that lands while the
    job is still starting (minutes on a large job) then stops it within its first steps instead of being lost.
    ``warm``: this process may train the next life itself, so in a hang that other ranks caused its watchdog
    leaves it a moment to fail on its own instead of ending it."""
    if watch is None:
        with PreemptionWatch([plan.signal]) as own:
            return _train(_Rank(plan, info, run_dir, log, own, warm))
    return _train(_Rank(plan, info, run_dir, log, watch, warm))


def _watchdog(rank: _Rank) -> Watchdog | None:
    """The hang watchdog of ``[watchdog]``; rank 0's decides with the attempt recorder once there is one."""
    plan, info, run_dir, log = rank.plan, rank.info, rank.run_dir, rank.log
    wcfg = plan.config.watchdog
    if not wcfg.enabled:
        return None
    policy = RetryPolicy.from_section(plan.config.retry)

    def decide(hang: Any) -> tuple[int, str]:
        return decide_hang(run_dir, info, rank.recorder, hang, policy, log)

    return Watchdog(run_dir, info.rank, info.world_size, attempt_key(info.job_id, info.restart, info.in_place),
                    Timeouts(wcfg.startup_timeout_s, wcfg.step_timeout_s, wcfg.checkpoint_timeout_s),
                    decide if info.rank == 0 else None, log, warm_wait_s=WARM_HANG_WAIT_S if rank.warm else 0.0)


def _train(rank: _Rank) -> dict[str, Any]:
    rank.watchdog = _watchdog(rank)
    if rank.watchdog is None:
        return _train_watched(rank)
    with rank.watchdog:
        return _train_watched(rank)


def _train_watched(rank: _Rank) -> dict[str, Any]:
    """The stages: set up, build, resume, then the steps (each may stop the run), then finish."""
    try:
        spec = model_spec(rank.plan.config.train.model)
        topology, groups = _set_up(rank)
        parts = _build(rank, spec, topology, groups)
        try:
            start_step = _resume(rank, parts)
        except BaseException as error:
            _release(rank, parts, error)
            raise
    except UserCodeError as error:  # the user's factory or dataset: a failed attempt, which is not retried
        AttemptRecorder(rank.run_dir, rank.info, 0, rank.plan.lead_seconds, rank.log).failed(0, error)
        raise
    monitor = _monitor(rank, parts, start_step)
    freeze_set_up()  # steps no longer scan the set-up's objects (rank/runtime/heap.py: 7 % of a step here)
    recorder = AttemptRecorder(rank.run_dir, rank.info, start_step, rank.plan.lead_seconds, rank.log)
    rank.recorder = recorder
    return _steps(rank, parts, monitor, recorder, _Progress(start_step, start_step))


def _set_up(rank: _Rank) -> tuple[Topology, ParallelGroups]:
    """Join the job (bootstrap), the injected faults of the tests, the threads, the groups, the precision."""
    plan, info = rank.plan, rank.info
    context = bootstrap(info, port_range=(plan.port_range[0], plan.port_range[1]), fabric_suffix=plan.fabric_suffix,
                        init_timeout_s=plan.config.dist.init_timeout_s, timeout_s=plan.config.dist.timeout_s)
    maybe_inject_fault(info.rank)
    if context.backend != "nccl":  # before DeepSpeed starts: it keeps the collectives it picks (comm_clock)
        CollectiveClock.install(injected_comm_delay_s(info.rank))
    torch.set_num_threads(max(1, int(plan.env.get("OMP_NUM_THREADS", "1"))))
    layout = plan.layout
    topology = Topology.build(info.world_size, tp=layout.tensor, pp=layout.pipeline, cp=layout.context,
                              order=layout.order)
    groups = ParallelGroups(topology, "cuda" if context.backend == "nccl" else "cpu")
    rank.plan = _resolve_precision(plan, context.backend, rank.log)
    return topology, groups


def _meta_build(config: Any, topology: Topology) -> bool:
    """FSDP2 builds the built-in GPT on the meta device (``fsdp.meta_init``) and draws its weights shard by shard
    (:class:`~hpc_train.rank.train.engine_fsdp2.Fsdp2Engine`); a user's model, or tensor parallelism, is built whole."""
    return (config.train.engine == "fsdp2" and config.fsdp.meta_init and config.train.model in MODEL_PRESETS
            and topology.sizes["tp"] == 1)


def _build(rank: _Rank, spec: ModelSpec, topology: Topology, groups: ParallelGroups) -> _Parts:
    """The model (its FLOPs counted before the engine wraps it), the data, the engine and its checkpoints
    (:mod:`hpc_train.rank.train.engines`), and the straggler check."""
    config, info = rank.plan.config, rank.info
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ctx = RankContext(rank.plan, info, rank.run_dir, groups, device)
    meta = _meta_build(config, topology)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = spec.build(ctx, topology, groups)
    flops = spec.flops_per_token(config, model)
    if info.rank == 0:
        write_model_card(rank.run_dir, model, config.train.model)
    data = build_data(ctx, groups, device, tuple(rank.watch.signals))
    if config.train.compile:  # in place and lazy: traced at the first step, after the engine's wrapping
        from hpc_train.rank.train.compiling import compile_blocks

        count = compile_blocks(model, config.train.compile_backend)
        rank.log(f"compile: {count} block(s) compiled with torch.compile (backend {config.train.compile_backend}); "
                 "the first step traces and compiles them")
    kind = engine_kind(config.train.engine)
    engine = kind.build(model, rank.plan, topology, groups, rank.run_dir, info.local_rank)
    if meta:
        rank.log("fsdp2: the model was built on the meta device and each rank drew only its own shards "
                 "(fsdp.meta_init)")
    checkpointer = kind.checkpoints(rank.plan, rank.run_dir, rank.log)
    checkpointer.time_saves(rank.plan.node_mtbf_hours, rank.plan.resources.nodes)
    return _Parts(groups, topology.sizes["pp"] > 1, model, engine, data, checkpointer,
                  StragglerCheck(config.watchdog.straggler_factor, info.rank, rank.log), flops,
                  f"train.model {config.train.model}", _breakdown(rank, device), _health(rank),
                  _gpu_readings(rank, device))


def _gpu_readings(rank: _Rank, device: torch.device) -> GpuReadings | None:
    if device.type != "cuda" or rank.info.rank != 0:
        return None
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "") or None
    return GpuReadings(device.index or 0, rank.log, uuid)


def _breakdown(rank: _Rank, device: torch.device) -> StepBreakdown:
    clock = CollectiveClock.install(injected_comm_delay_s(rank.info.rank)) if device.type == "cpu" else None
    return StepBreakdown(device, clock=clock, sample_every=rank.plan.config.monitor.comm_sample_every)


def _health(rank: _Rank) -> HealthCheck:
    monitor, data = rank.plan.config.monitor, rank.plan.config.data
    limits = Thresholds(monitor.health_data_share, monitor.health_loss_spike, monitor.health_memory_growth,
                        data.num_workers, monitor.health_comm_share, monitor.health_gpu_utilisation,
                        monitor.health_gpu_memory, dist.get_backend() == "nccl",
                        dist.get_backend() == "nccl" or rank.plan.resources.nodes > 1)
    return HealthCheck(rank.run_dir, limits, rank.log, writer=rank.info.rank == 0)


def _resume(rank: _Rank, parts: _Parts) -> int:
    """Load the run's latest verified checkpoint, if any; return the step it holds (0 without one)."""
    start_step, sampler_state = parts.checkpointer.resume(parts.engine)
    sampler, steps = parts.stream.position, rank.plan.config.train.steps
    if sampler_state is not None:
        parts.stream.load_state_dict(sampler_state)
        rank.log(f"resumed from step {start_step} (epoch {sampler.epoch}, offset {sampler.offset})")
    if start_step >= steps:
        rank.log(f"nothing to train: the run's checkpoint is at step {start_step} of {steps}; raise train.steps "
                 "to go on, or set checkpoint.resume = false to start over")
    return start_step


def _monitor(rank: _Rank, parts: _Parts, start_step: int) -> Monitor:
    config, info = rank.plan.config, rank.info
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return Monitor.create(info.rank, run_dir=rank.run_dir, total_steps=config.train.steps,
                          log_every=config.monitor.log_every, tensorboard=config.monitor.tensorboard,
                          histogram_every=config.monitor.histogram_every,
                          flops_per_token=parts.flops_per_token,
                          peak_flops=peak_flops(device, config.train.precision) * info.world_size,
                          console=Console(file=LogLines(rank.log), width=200), start_step=start_step,
                          exporters=lambda: build_exporters(rank.plan, rank.run_dir, rank.log))


def _steps(rank: _Rank, parts: _Parts, monitor: Monitor, recorder: AttemptRecorder,
           progress: _Progress) -> dict[str, Any]:
    """Every step of this attempt; a preemption signal stops it (saved), the last step finishes it."""
    try:
        with monitor:
            for step in range(progress.start_step + 1, rank.plan.config.train.steps + 1):
                progress.step = step
                _step(rank, parts, monitor, recorder, progress)
                stopped_by = _after_step(rank, parts, monitor, progress)
                if stopped_by:
                    monitor.close()  # every record out (W&B finished) before the save and the requeue's SIGTERM
                    return _stop(rank, parts, recorder, step, stopped_by)
                if parts.checkpointer.due(step, rank.plan.config.train.steps):
                    _progress(rank.watchdog, "checkpoint", step)
                    saved = time.perf_counter()
                    parts.checkpointer.save(parts.engine, step, parts.stream.state_dict())
                    took = time.perf_counter() - saved
                    recorder.save_time(took)
                    if step < rank.plan.config.train.steps:  # the next save's step, where there is one
                        parts.checkpointer.saved(step, took)
                if step < rank.plan.config.train.steps and parts.checkpointer.memory_due(step):  # in seconds
                    _progress(rank.watchdog, "checkpoint", step)
                    parts.checkpointer.save_to_memory(parts.engine, step, parts.stream.state_dict())
                _progress(rank.watchdog, "step", step)
        rank.watch.settle()
        parts.stream.close()
        _progress(rank.watchdog, "checkpoint", progress.step)
        parts.checkpointer.finish()  # a background seal of the last checkpoint is durable before the attempt ends
    except BaseException as error:
        if rank.watchdog is not None:  # a hang's warm rank: its watchdog no longer ends the process
            rank.watchdog.leave()
        recorder.failed(progress.step, error)
        _release(rank, parts, error)
        raise
    return _finish(rank, parts, recorder, progress)


def _release(rank: _Rank, parts: _Parts, error: BaseException) -> None:
    """Where this process may train the next life itself (a warm restart, :mod:`hpc_train.rank.entry`), a life that
    failed with ``error`` lets go of its data workers, its checkpoint writer threads and their staging buffers, its
    process group and its engine (:func:`end_life`), and says so on ``error``. Elsewhere the process is on its way
    out: nothing delays the record of its failure."""
    if not rank.warm:
        return
    for close in (parts.stream.close, parts.checkpointer.close):
        with contextlib.suppress(Exception):
            close()
    end_life(parts.engine)
    mark_released(error)


def _micro_batches(rank: _Rank, parts: _Parts, logged: bool) -> float:
    """One optimizer step of ``grad_accum`` micro-batches outside a pipeline; the loss averaged over the data
    ranks on logged steps only (a collective), NaN otherwise."""
    engine, accum, delay = parts.engine, rank.plan.config.train.grad_accum, injected_delay_s(rank.info.rank)
    timing = parts.breakdown
    total: torch.Tensor | None = None  # summed on the device: a float() per micro-batch would sync a GPU each time
    with timing.sampled(logged):
        for _ in range(accum):
            with timing.phase("data"):
                batch = next(parts.stream)
            with parts.stragglers.timed(engine.device), timing.phase("forward"):
                if delay:
                    time.sleep(delay)  # an injected straggler (HPC_TRAIN_INJECT_FAULT=slow:R:MS)
                micro_loss = forward_loss(engine, batch, parts.said)
            with timing.phase("backward"):
                engine.backward(micro_loss)
            with timing.phase("optimizer"):
                engine.step()
            total = micro_loss.detach() if total is None else total + micro_loss.detach()
    if not logged or total is None:
        return float("nan")
    return _mean_over(float(total) / accum, parts.groups.group("dp"))


def _step(rank: _Rank, parts: _Parts, monitor: Monitor, recorder: AttemptRecorder, progress: _Progress) -> None:
    """One optimizer step, and its progress line and metrics when due."""
    step, engine = progress.step, parts.engine
    start = time.perf_counter()
    lr = engine.get_lr()[0]  # the rate this step uses; the scheduler moves on inside engine.step()
    logged = monitor.log_due(step)
    if parts.pipelined:
        from hpc_train.rank.train.pipeline import train_step

        progress.loss = train_step(engine, parts.stream)  # already the global batch's mean, on every rank
    else:
        progress.loss = _micro_batches(rank, parts, logged)
    maybe_inject_fault(rank.info.rank, step)
    leak = injected_leak_bytes(rank.info.rank)
    if leak:  # a test-only leak: memory held across steps, as a loss kept without .item() would be
        parts.leaked.append(torch.ones(leak, dtype=torch.uint8, device=engine.device))
    straggler = parts.stragglers.check(step) if logged else None
    norm = engine.get_global_grad_norm() if logged else None
    elapsed = time.perf_counter() - start
    parts.breakdown.step_done(elapsed)
    breakdown = parts.breakdown.collect() if logged and not parts.pipelined else None  # collective
    tokens_per_step = rank.plan.layout.global_batch * rank.plan.config.train.seq_len
    memory = _memory_bytes() if logged else None
    if logged and parts.gpu is not None:
        breakdown = {**(breakdown or {}), **parts.gpu.read()}  # NVML's view of rank 0's GPU, in the same record
    monitor.step(step, progress.loss, lr, None if norm is None else float(norm), tokens_per_step, elapsed, memory,
                 breakdown)
    if logged:
        parts.health.observe(step, {"loss": progress.loss, "memory_bytes": memory, **(breakdown or {})})
        parts.health.straggler(step, straggler, rank.plan.config.watchdog.straggler_factor)
    if step > progress.start_step + 1:  # the first step of an attempt also warms up
        recorder.step_time(elapsed)
    elif rank.plan.config.train.compile and rank.info.rank == 0:
        from hpc_train.rank.train.compiling import compile_report

        rank.log(compile_report(elapsed))


def _after_step(rank: _Rank, parts: _Parts, monitor: Monitor, progress: _Progress) -> int:
    """Whether the ranks agreed on a preemption signal (its number, else 0), after the histograms and the
    evaluation that are due; the last step settles the watch instead (no save, no requeue needed)."""
    step, engine, watch, config = progress.step, parts.engine, rank.watch, rank.plan.config
    last = step == config.train.steps
    if last:
        watch.settle()  # the run is done: a signal now needs no save and no requeue
    stopped_by = 0 if last else watch.poll()
    if not stopped_by and monitor.histograms_due(step):
        local = ((name, p.to_local() if hasattr(p, "to_local") else p) for name, p in parts.model.named_parameters())
        monitor.histograms(step, local)  # FSDP2's parameters are DTensors: rank 0's shard, as under ZeRO-3
    every = config.monitor.eval_every
    if not stopped_by and every and (step % every == 0 or last):
        result = _evaluate(engine, parts.data, parts.groups, None if last else watch, parts.said)
        if result is not None:
            progress.eval_loss = result
            monitor.eval(step, progress.eval_loss)
        elif not last:  # cut short by a signal (or no evaluation set: then nothing was received)
            stopped_by = watch.agreed()
    return stopped_by


def _finish(rank: _Rank, parts: _Parts, recorder: AttemptRecorder, progress: _Progress) -> dict[str, Any]:
    """Record the attempt as completed, leave the process group, and return this rank's summary."""
    parts.health.close()  # a change still waiting its turn (health.json is written at most every 10 s)
    recorder.completed(progress.step)
    shutdown()
    info, config = rank.info, rank.plan.config
    return {"rank": info.rank, "steps": config.train.steps, "start_step": progress.start_step,
            "final_loss": progress.loss, "eval_loss": progress.eval_loss, "precision": config.train.precision,
            "world_size": info.world_size, "launcher": info.launcher, "sampler": parts.stream.state_dict()}
