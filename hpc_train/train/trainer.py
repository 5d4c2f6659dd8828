"""The training loop every rank runs: bootstrap, groups, model, DeepSpeed engine, data, and rank-0 monitoring.

Kept to the loop itself; the pieces live in their own modules (model, engine, data, monitor, flops).
"""

from __future__ import annotations

import dataclasses
import io
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from hpc_train.config.job import JobConfig
from hpc_train.config.plan import Plan
from hpc_train.distributed.bootstrap import bootstrap, shutdown
from hpc_train.distributed.faults import injected_delay_s, maybe_inject_fault
from hpc_train.distributed.launchers import LaunchInfo
from hpc_train.distributed.mesh import ModelParallelUnit, ParallelGroups
from hpc_train.distributed.topology import Topology
from hpc_train.run.loglines import format_saved_after_signal
from hpc_train.train.checkpointing import Checkpointer
from hpc_train.train.data import ResumableSampler, batch, make_source
from hpc_train.train.engine import build_engine
from hpc_train.train.flops import flops_per_token, peak_flops
from hpc_train.train.model import GPT, GPTConfig, count_parameters
from hpc_train.train.monitor import Monitor
from hpc_train.train.pipeline import build_pipeline_model, eval_step, train_step
from hpc_train.train.precision import agreed_precision
from hpc_train.train.preemption import PreemptionWatch, arm_force_exit
from hpc_train.train.stopping import AttemptRecorder, decide_hang, signal_name
from hpc_train.train.stragglers import StragglerCheck
from hpc_train.train.watchdog import Timeouts, Watchdog

__all__ = ["train"]


class _LogLines(io.TextIOBase):
    """A text stream that hands each complete line to ``log``: progress goes into the rank-0 log, which
    ``hpc_train.submit`` follows on the login node (a rank's stdout is a file on the compute node)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self._log = log
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if line.strip():
                self._log(line)
        return len(text)


def _memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mean_over(value: float, group: Any) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return float(tensor.item()) / dist.get_world_size(group)


def _batches(source: Any, sampler: ResumableSampler, seq_len: int, device: Any) -> Iterator[Any]:
    while True:
        yield tuple(t.to(device) for t in batch(source, sampler.next_indices(), seq_len))


def _evaluate(engine: Any, source: Any, config: JobConfig, groups: ParallelGroups,
              watch: PreemptionWatch | None, batches: int = 4) -> float | None:
    """Loss on a fixed set of batches (the same at every evaluation), averaged over data-parallel ranks; None
    when a preemption signal cut it short (the ranks agree on that between batches; not with ``watch`` None,
    the evaluation after the last step, which a signal no longer stops)."""
    train = config.train
    sampler = ResumableSampler(source.num_samples(train.seq_len), groups.coord("dp"), groups.size("dp"),
                               train.micro_batch, seed=train.seed + 7919)
    stream = _batches(source, sampler, train.seq_len, engine.device)
    if groups.size("pp") > 1:
        return eval_step(engine, stream, micro_batches=batches)
    engine.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for _ in range(batches):
                if watch is not None and watch.agreed(engine.device):
                    return None
                total += float(engine(*next(stream)))
    finally:
        engine.train()
    return _mean_over(total / batches, groups.group("dp"))


def _model_and_engine(model_config: GPTConfig, topology: Topology, groups: ParallelGroups, config: JobConfig,
                      run_dir: Path, local_rank: int) -> tuple[Any, Any]:
    """The GPT, or its pipeline stages, inside a DeepSpeed engine. The layers always get the tensor group, even
    of size 1: they read None as "the default group", which would be every rank."""
    seed, data_parallel = config.train.seed, topology.sizes["dp"]
    if topology.sizes["pp"] > 1:  # DeepSpeed's pipeline engine brings its own grid: no mpu
        model = build_pipeline_model(model_config, topology, groups.group("tp"), seed=seed, local_rank=local_rank)
        return model, build_engine(model, config, data_parallel, None, run_dir, local_rank)
    model = GPT(model_config, groups.group("tp"), seed=seed)
    return model, build_engine(model, config, data_parallel, ModelParallelUnit(groups), run_dir,
                                local_rank)


def _resolve_precision(plan: Plan, backend: str, log: Callable[[str], None]) -> Plan:
    """``plan`` with ``train.precision`` decided on this hardware (``"auto"``), the same on every rank."""
    requested = plan.config.train.precision
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    precision, reason = agreed_precision(requested, device)
    log(f"precision: {requested} -> {precision} ({reason})" if requested == "auto" else f"precision: {precision}")
    config = dataclasses.replace(plan.config, train=dataclasses.replace(plan.config.train, precision=precision))
    return dataclasses.replace(plan, config=config)


def _progress(watchdog: Watchdog | None, phase: str, step: int) -> None:
    if watchdog is not None:
        watchdog.enter(phase, step)


def _stop(plan: Plan, info: LaunchInfo, engine: Any, checkpointer: Checkpointer, recorder: AttemptRecorder,
          sampler: ResumableSampler, step: int, signum: int, watch: PreemptionWatch,
          log: Callable[[str], None], watchdog: Watchdog | None) -> dict[str, Any]:
    """All ranks agreed on a preemption signal after ``step``: save it (a force-exit timer guards the save), let
    rank 0 record the attempt and requeue, and return how this rank must exit."""
    name = signal_name(signum)
    received = watch.received_at or time.time()
    budget = max(10.0, plan.lead_seconds - (time.time() - received) - 5)
    log(f"{name} received: saving step {step}, then stopping (the save must finish within {budget:.0f} s)")
    timer = arm_force_exit(budget, log)
    if watchdog is not None:
        watchdog.enter("checkpoint", step)
    try:
        saved = time.perf_counter()
        checkpointer.save(engine, step, sampler.state_dict(), wait=True)  # durable before the requeue
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
          watch: PreemptionWatch | None = None) -> dict[str, Any]:
    """Train ``plan`` on this rank; ``log`` takes rank 0's progress lines. Returns this rank's summary.

    ``watch`` should be installed as the rank starts (``hpc_train.launch`` does): a signal that lands while the
    job is still starting (minutes on a large job) then stops it within its first steps instead of being lost."""
    if watch is None:
        with PreemptionWatch([plan.signal]) as own:
            return _train(plan, info, run_dir, log, own)
    return _train(plan, info, run_dir, log, watch)


def _watchdog(plan: Plan, info: LaunchInfo, run_dir: Path, log: Callable[[str], None],
              recorder: list[AttemptRecorder]) -> Watchdog | None:
    """The hang watchdog of ``[watchdog]``; rank 0's decides with the attempt recorder once there is one."""
    wcfg = plan.config.watchdog
    if not wcfg.enabled:
        return None
    retries = plan.config.retry.hang

    def decide(hang: Any) -> tuple[int, str]:
        return decide_hang(run_dir, info, recorder[0] if recorder else None, hang, retries, log)

    return Watchdog(run_dir, info.rank, info.world_size, f"{info.job_id or 'local'}.{info.restart}",
                    Timeouts(wcfg.startup_timeout_s, wcfg.step_timeout_s, wcfg.checkpoint_timeout_s),
                    decide if info.rank == 0 else None, log)


def _train(plan: Plan, info: LaunchInfo, run_dir: Path, log: Callable[[str], None],
           watch: PreemptionWatch) -> dict[str, Any]:
    recorder_box: list[AttemptRecorder] = []  # filled once the attempt is open; the watchdog's decision reads it
    watchdog = _watchdog(plan, info, run_dir, log, recorder_box)
    if watchdog is None:
        return _train_watched(plan, info, run_dir, log, watch, None, recorder_box)
    with watchdog:
        return _train_watched(plan, info, run_dir, log, watch, watchdog, recorder_box)


def _train_watched(plan: Plan, info: LaunchInfo, run_dir: Path, log: Callable[[str], None], watch: PreemptionWatch,
                   watchdog: Watchdog | None, recorder_box: list[AttemptRecorder]) -> dict[str, Any]:
    config = plan.config
    tcfg, layout = config.train, plan.layout
    context = bootstrap(info, port_range=(plan.port_range[0], plan.port_range[1]), fabric_suffix=plan.fabric_suffix,
                        init_timeout_s=config.dist.init_timeout_s, timeout_s=config.dist.timeout_s)
    maybe_inject_fault(info.rank)
    torch.set_num_threads(max(1, int(plan.env.get("OMP_NUM_THREADS", "1"))))
    topology = Topology.build(info.world_size, tp=layout.tensor, pp=layout.pipeline, cp=layout.context,
                              order=layout.order)
    groups = ParallelGroups(topology, "cuda" if context.backend == "nccl" else "cpu")
    plan = _resolve_precision(plan, context.backend, log)
    config = plan.config
    tcfg = config.train
    model_config = GPTConfig.from_preset(tcfg.model, config.data.vocab_size, tcfg.seq_len)
    model, engine = _model_and_engine(model_config, topology, groups, config, run_dir, info.local_rank)
    pipelined = layout.pipeline > 1
    source = make_source(config.data.source, config.data.path, config.data.vocab_size,
                         tcfg.seed)
    sampler = ResumableSampler(source.num_samples(tcfg.seq_len), groups.coord("dp"), groups.size("dp"),
                               tcfg.micro_batch, seed=tcfg.seed)
    checkpointer = Checkpointer(run_dir, config, layout, plan.config_hash, log=log)
    start_step, sampler_state = checkpointer.resume(engine)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
        log(f"resumed from step {start_step} (epoch {sampler.epoch}, offset {sampler.offset})")
    if start_step >= tcfg.steps:
        log(f"nothing to train: the run's checkpoint is at step {start_step} of {tcfg.steps}; raise train.steps "
            "to go on, or set checkpoint.resume = false to start over")
    tokens_per_step = layout.global_batch * tcfg.seq_len
    # N for 6N: the parameters of matrix multiplies, so neither the position nor the (untied) input embedding.
    matmul_params = count_parameters(model_config) - (model_config.vocab_size + model_config.seq_len) * \
        model_config.hidden
    per_token = flops_per_token(matmul_params, model_config.layers, model_config.hidden, tcfg.seq_len)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    monitor_config = config.monitor
    monitor = Monitor.create(info.rank, run_dir=run_dir, total_steps=tcfg.steps,
                             log_every=monitor_config.log_every, tensorboard=monitor_config.tensorboard,
                             histogram_every=monitor_config.histogram_every, flops_per_token=per_token,
                             peak_flops=peak_flops(device, tcfg.precision) * info.world_size,
                             console=Console(file=_LogLines(log), width=200), start_step=start_step)
    loss = eval_loss = float("nan")
    stream = _batches(source, sampler, tcfg.seq_len, engine.device)
    recorder = AttemptRecorder(run_dir, info, start_step, plan.lead_seconds, log)
    recorder_box.append(recorder)
    stragglers = StragglerCheck(config.watchdog.straggler_factor, info.rank, log)
    delay = injected_delay_s(info.rank)
    step, stopped_by = start_step, 0
    try:
        with monitor:
            for step in range(start_step + 1, tcfg.steps + 1):
                start = time.perf_counter()
                lr = engine.get_lr()[0]  # the rate this step uses; the scheduler moves on inside engine.step()
                logged = monitor.log_due(step)
                if pipelined:
                    loss = train_step(engine, stream)  # already the global batch's mean, on every rank
                else:
                    total = 0.0
                    for _ in range(tcfg.grad_accum):
                        inputs, targets = next(stream)
                        with stragglers.timed(engine.device):
                            if delay:
                                time.sleep(delay)  # an injected straggler (HPC_TRAIN_INJECT_FAULT=slow:R:MS)
                            micro_loss = engine(inputs, targets)
                        engine.backward(micro_loss)
                        engine.step()
                        total += float(micro_loss)
                    # The loss average and the gradient norm cost a collective each: only on logged steps.
                    loss = _mean_over(total / tcfg.grad_accum, groups.group("dp")) if logged else float("nan")
                maybe_inject_fault(info.rank, step)
                if logged:
                    stragglers.check(step, engine.device)
                norm = engine.get_global_grad_norm() if logged else None
                elapsed = time.perf_counter() - start
                monitor.step(step, loss, lr, None if norm is None else float(norm), tokens_per_step, elapsed,
                             _memory_bytes() if logged else None)
                if step > start_step + 1:  # the first step of an attempt also warms up
                    recorder.step_time(elapsed)
                last = step == tcfg.steps
                if last:
                    watch.settle()  # the run is done: a signal now needs no save and no requeue
                stopped_by = 0 if last else watch.poll(engine.device)
                if not stopped_by and monitor.histograms_due(step):
                    monitor.histograms(step, model.named_parameters())
                if not stopped_by and monitor_config.eval_every and (
                        step % monitor_config.eval_every == 0 or step == tcfg.steps):
                    result = _evaluate(engine, source, config, groups, None if last else watch)
                    if result is None:
                        stopped_by = watch.agreed(engine.device)
                    else:
                        eval_loss = result
                        monitor.eval(step, eval_loss)
                if stopped_by:
                    return _stop(plan, info, engine, checkpointer, recorder, sampler, step, stopped_by, watch, log,
                                 watchdog)
                if checkpointer.due(step, tcfg.steps):
                    _progress(watchdog, "checkpoint", step)
                    saved = time.perf_counter()
                    checkpointer.save(engine, step, sampler.state_dict())
                    recorder.save_time(time.perf_counter() - saved)
                _progress(watchdog, "step", step)
        watch.settle()
        _progress(watchdog, "checkpoint", step)
        checkpointer.finish()  # a background seal of the last checkpoint is durable before the attempt ends
    except BaseException as error:
        recorder.failed(step, error)
        raise
    recorder.completed(step)
    shutdown()
    return {"rank": info.rank, "steps": tcfg.steps, "start_step": start_step, "final_loss": loss,
            "eval_loss": eval_loss, "precision": tcfg.precision,
            "world_size": info.world_size, "launcher": info.launcher, "sampler": sampler.state_dict()}
