"""Health checks on rank 0's logged steps: a verdict on why a run is slow or going wrong, with the fix.

Each check reads what the trainer logs anyway (the step-time breakdown, the loss, the memory, the straggler
check), so it costs nothing on the step. A finding is said once in rank 0's log when it first trips and once when
it clears, and the run folder keeps the current state in ``health.json`` (written whole, atomically), which
``status`` shows. Thresholds are ``[monitor] health_*``; 0 turns a check off.

- ``data_wait``: the step waits on the loader for more than ``health_data_share`` of its time;
- ``comm``: the step waits in communication that compute did not hide for more than ``health_comm_share``;
- ``loss``: a NaN or infinite loss (always), or one above ``health_loss_spike`` times the mean of the last 5;
- ``memory_growth``: memory grew at each of the last 5 logged steps, by more than ``health_memory_growth``;
- ``gpu_utilisation``: rank 0's GPU busy less than ``health_gpu_utilisation`` of the time (NVML, GPU nodes only);
- ``gpu_memory``: rank 0's GPU memory above ``health_gpu_memory`` of its total (an out-of-memory error is near);
- ``straggler``: a rank whose forward pass is ``watchdog.straggler_factor`` times the median (named by the
  straggler check, which is folded in here).

Why a share check clears below three quarters of its threshold: a figure that hovers around it (gloo's
communication share of 20-22 % on CPU ranks against 20 %) would trip and clear it at one logged step after
another, ninety words each time; with two thresholds it trips once and clears once, when the figure really fell.

Why health.json is not rewritten at every change: a figure may still swing across both thresholds from one
logged step to the next (a share of 30 % then 10 % against 20 %), and each rewrite is four
metadata operations on the shared file system (create, chmod, rename, the folder's fsync). A check's first trip
in an attempt is written at once; later changes at most every :data:`_MIN_WRITE_S` (10 s), at the first logged
step after it, and before the rank leaves (``quick_exit.on_leave``); the log says each change as it comes.

Plain Python, no torch; ``status`` on the login node reads the same file (``hpc_train.login.ops.status``).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc_train.run.files import atomic_write
from hpc_train.run.paths import HEALTH_FILE
from hpc_train.run.quick_exit import on_leave

__all__ = ["Finding", "HealthCheck", "RecordHealth", "Thresholds"]

_WINDOW = 5
_REFRESH_S = 60.0  # a tripped finding's figures are rewritten at most this often (each write is fsynced)
_MIN_WRITE_S = 10.0  # changes after a check's first trip are written at most this often (module note)
_CLEAR_AT = 0.75  # a tripped share check clears below this fraction of its threshold (hysteresis: module note)
_LOOPBACK_COMM_SHARE = 0.8  # the comm threshold of CPU ranks on one node (Thresholds.network), at the least


@dataclass(frozen=True)
class Thresholds:
    """``[monitor]``'s health thresholds (0 disables a check)."""

    data_share: float = 0.3
    loss_spike: float = 3.0
    memory_growth: float = 0.1
    num_workers: int = 0  # what the fix says about the loader now (-1: a program's own loader)
    comm_share: float = 0.2
    gpu_utilisation: float = 0.7
    gpu_memory: float = 0.95
    gpus: bool = True  # GPU ranks (NCCL) or CPU ranks (gloo): what a high communication share most likely means
    # whether communication crosses a network: not for CPU ranks on one node, whose gloo traffic over loopback
    # waits mostly on the other ranks sharing the node's cores (the quick start's two ranks: 20-60 % of a step);
    # their comm check trips only above _LOOPBACK_COMM_SHARE, a collective that is really stuck
    network: bool = True


@dataclass(frozen=True)
class Finding:
    """One tripped check: what was measured, against what, why that happens and what to do."""

    check: str
    step: int
    figure: str
    threshold: str
    cause: str
    fix: str

    def line(self) -> str:
        return (f"health: {self.check} at step {self.step}: {self.figure} (threshold {self.threshold}); likely "
                f"{self.cause}; fix: {self.fix}")


class HealthCheck:
    """Rank 0's checks; on other ranks (``writer`` False) it keeps no state and writes nothing."""

    def __init__(self, run_dir: Path, thresholds: Thresholds, log: Callable[[str], None], writer: bool = True,
                 min_write_s: float = _MIN_WRITE_S) -> None:
        self.path = Path(run_dir) / HEALTH_FILE
        self.limits, self.log, self.writer = thresholds, log, writer
        self.active: dict[str, Finding] = {}
        self.history: list[dict[str, Any]] = []
        self._losses: deque[float] = deque(maxlen=_WINDOW)
        self._memory: deque[float] = deque(maxlen=_WINDOW + 1)
        # (check, the record key it reads, its verdict on a record that has the key)
        self._checks: tuple[tuple[str, str, Callable[[int, Mapping[str, Any]], Finding | None]], ...] = (
            ("data_wait", "data_share", self._data_wait), ("comm", "comm_share", self._comm),
            ("loss", "loss", lambda step, record: self._loss(step, record["loss"])),
            ("gpu_utilisation", "gpu_utilisation", self._gpu_utilisation),
            ("gpu_memory", "gpu_memory_share", self._gpu_memory),
            ("memory_growth", "memory_bytes", lambda step, record: self._memory_growth(step, record["memory_bytes"])))
        self._written = 0.0
        self._min_write_s = min_write_s
        self._seen: set[str] = set()  # checks that tripped in this attempt: their first trip is written at once
        self._unwritten = False  # a change health.json does not hold yet
        self._urgent = False  # among them a check's first trip
        if writer and self.path.exists():  # an earlier attempt's findings are history: this one starts clear
            self._write()
        # a change still waiting its turn when the rank leaves through quick_exit; close() takes the hook off
        self._off_leave = on_leave(self.flush) if writer else None

    def observe(self, step: int, record: Mapping[str, Any]) -> None:
        """A logged step's metrics record (``loss``, ``memory_bytes``, ``data_share``, ...)."""
        if not self.writer:
            return
        changed = False
        for check, key, verdict in self._checks:  # a check whose figure the record lacks has nothing to say
            if key in record:
                changed |= self._set(check, step, verdict(step, record))
            elif check in self.active and key != "loss":
                changed |= self._set(check, step, None)
        self._write_when_due(changed)

    def straggler(self, step: int, found: tuple[int, str, float] | None, factor: float) -> None:
        """The straggler check's verdict on a logged step (None: no rank stands out)."""
        if not self.writer:
            return
        finding = None
        if found is not None:
            rank, host, ratio = found
            finding = Finding("straggler", step, f"rank {rank} on {host} takes {ratio:.1f}x the median forward time",
                              f"{factor:g}x", "a slow or throttled node (thermals, a noisy neighbour, a failing GPU)",
                              f"python -m hpc_train doctor on {host}; if it stays slow, exclude it "
                              "(docs/operations.md: the retry policy and the exclusion list)")
        self._write_when_due(self._set("straggler", step, finding))

    # -- the checks -------------------------------------------------------------------------------------------

    def _above(self, check: str, share: Any, limit: float) -> bool:
        """Whether ``share`` trips ``check`` (above ``limit``), or keeps it tripped (above ``_CLEAR_AT`` of it)."""
        bar = limit * _CLEAR_AT if check in self.active else limit
        return bool(limit) and isinstance(share, int | float) and share > bar

    def _data_wait(self, step: int, record: Mapping[str, Any]) -> Finding | None:
        share, limit = record.get("data_share"), self.limits.data_share
        if not self._above("data_wait", share, limit):
            return None
        workers = self.limits.num_workers
        fix = (f"raise data.num_workers (now {workers}) and data.prefetch_factor; on GPUs set data.pin_memory = true"
               if workers >= 0 else "give your DataLoader more num_workers and a prefetch_factor; on GPUs "
               "pin_memory=True")
        return Finding("data_wait", step, f"{share:.0%} of the step waits for data", f"{limit:.0%}",
                       "a loader that does not keep up (samples loaded or decoded in the training process, too few "
                       "workers)", fix)

    def _comm(self, step: int, record: Mapping[str, Any]) -> Finding | None:
        share, limit = record.get("comm_share"), self.limits.comm_share
        if limit and not self.limits.network:
            limit = max(limit, _LOOPBACK_COMM_SHARE)
        if not self._above("comm", share, limit):
            return None
        slowest = record.get("comm_ms_max")
        spread = f" (up to {slowest:.0f} ms a step on the slowest rank)" if isinstance(slowest, int | float) else ""
        if "straggler" in self.active:
            cause = "ranks waiting in collectives for the straggler named by the straggler check"
        elif self.limits.gpus:
            cause = ("a fabric slower than the model's communication needs (a fall-back to TCP sockets, a missing "
                     "InfiniBand setting), or too little compute per step to hide it")
        else:
            cause = ("gloo over TCP between CPU ranks, and ranks that share a node's cores waiting for each other; "
                     "too little compute per step to hide it")
        return Finding("comm", step, f"{share:.0%} of the step waits in communication{spread}", f"{limit:.0%}", cause,
                       "python -m hpc_train doctor and python -m hpc_train bench allreduce on the job's nodes, then "
                       "the site's [network] NCCL settings (docs/troubleshooting.md); a larger train.global_batch "
                       "through train.grad_accum makes communication a smaller share of each step")

    def _gpu_utilisation(self, step: int, record: Mapping[str, Any]) -> Finding | None:
        busy, limit = record.get("gpu_utilisation"), self.limits.gpu_utilisation
        if not limit or not isinstance(busy, int | float) or busy >= limit:
            return None
        if "data_wait" in self.active:
            cause, fix = "the loader starving the GPU (the data_wait check says so too)", "see data_wait's fix"
        elif "comm" in self.active:
            cause, fix = "the GPU waiting on communication (the comm check says so too)", "see comm's fix"
        else:
            cause = "too little work per kernel (a small micro batch or model) or host-side overhead between steps"
            fix = ("raise train.micro_batch (train.grad_accum down to keep train.global_batch); python -m "
                   "hpc_train validate --memory shows what fits")
        return Finding("gpu_utilisation", step, f"rank 0's GPU is busy {busy:.0%} of the time", f"{limit:.0%}",
                       cause, fix)

    def _gpu_memory(self, step: int, record: Mapping[str, Any]) -> Finding | None:
        share, limit = record.get("gpu_memory_share"), self.limits.gpu_memory
        if not limit or not isinstance(share, int | float) or share <= limit:
            return None
        return Finding("gpu_memory", step, f"rank 0's GPU memory is {share:.0%} full", f"{limit:.0%}",
                       "activations and optimizer state close to the GPU's size: the next larger batch or a "
                       "fragmented allocator ends in an out-of-memory error",
                       "lower train.micro_batch (raise train.grad_accum), a higher zero.stage, or zero offload; "
                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation")

    def _loss(self, step: int, loss: Any) -> Finding | None:
        if not isinstance(loss, int | float) and loss is not None:
            return None
        fix = ("lower train.lr or raise train.warmup_steps; a larger train.global_batch through train.grad_accum; "
               "keep train.grad_clip on; bf16 rather than fp16")
        if loss is None or not math.isfinite(loss):  # metrics.jsonl writes NaN and infinity as null
            return Finding("loss", step, "the loss is NaN or infinite", "finite",
                           "an unstable step (a learning rate or batch size the model cannot take, an fp16 overflow)",
                           fix)
        previous = list(self._losses)
        self._losses.append(float(loss))
        limit = self.limits.loss_spike
        if not limit or len(previous) < _WINDOW:
            return None
        mean = sum(previous) / len(previous)
        if mean <= 0 or loss <= limit * mean:
            return None
        return Finding("loss", step, f"loss {loss:.4g} is {loss / mean:.1f}x the mean of the last {_WINDOW} logged",
                       f"{limit:g}x", "a batch size that destabilises the loss, or a bad batch", fix)

    def _memory_growth(self, step: int, memory: Any) -> Finding | None:
        if not isinstance(memory, int | float) or memory <= 0:
            return None
        self._memory.append(float(memory))
        limit, seen = self.limits.memory_growth, list(self._memory)
        if not limit or len(seen) <= _WINDOW or any(b <= a for a, b in itertools.pairwise(seen)):
            return None
        growth = seen[-1] / seen[0] - 1
        if growth <= limit:
            return None
        return Finding("memory_growth", step, f"memory grew {growth:.0%} over the last {_WINDOW} logged steps "
                       f"(to {seen[-1] / 2**30:.2f} GiB)", f"{limit:.0%}",
                       "a leak: tensors kept across steps (a loss appended without .item(), a growing cache)",
                       "find what holds tensors between steps; torch.cuda.memory_summary() on rank 0 shows where")

    # -- state ------------------------------------------------------------------------------------------------

    def _set(self, check: str, step: int, finding: Finding | None) -> bool:
        """Record ``check``'s verdict; True when it tripped or cleared (each said once in the log)."""
        before = self.active.get(check)
        if finding is not None:
            self.active[check] = finding
            if before is None:
                self._urgent |= check not in self._seen
                self._seen.add(check)
                self.log(finding.line())
                self.history.append({"check": check, "step": step, "event": "tripped", "time": time.time()})
            return before is None
        if before is None:
            return False
        del self.active[check]
        self.log(f"health: {check} cleared at step {step}")
        self.history.append({"check": check, "step": step, "event": "cleared", "time": time.time()})
        return True

    def flush(self) -> None:
        """Write a change that waits for its turn (at the end of a run: the log said it, health.json too now)."""
        if self.writer and self._unwritten:
            self._write()

    def close(self) -> None:
        """The end of this check's run: what waits is written, and the leave hook goes (a process that trains
        again, through the Python API or a test, keeps no earlier check alive)."""
        self.flush()
        if self._off_leave is not None:
            self._off_leave()
            self._off_leave = None

    def _write_when_due(self, changed: bool) -> None:
        self._unwritten |= changed
        since = time.monotonic() - self._written
        if (self._unwritten and (self._urgent or since >= self._min_write_s)) or (self.active and since > _REFRESH_S):
            self._write()

    def _write(self) -> None:
        self._unwritten = self._urgent = False
        data = {"updated": time.time(), "findings": [asdict(f) for f in self.active.values()],
                "history": self.history[-100:]}
        atomic_write(self.path, json.dumps(data, indent=2) + "\n")
        self._written = time.monotonic()



class RecordHealth:
    """The checks over a program's ``ctx.log`` records, as one of the monitor's record consumers (rank 0):
    ``loss`` when the program logs one, the data wait when it times a ``ctx.timer("data")`` section (its share of
    the record's ``step_time_s``), and memory when it logs ``memory_bytes``. Like the trainer's, the checks look
    at every ``every``-th step (``monitor.log_every``: the records the progress line shows), and at any record
    whose loss is NaN or infinite, at once; a program that logs every step pays for a tenth of them."""

    def __init__(self, health: HealthCheck, every: int = 1) -> None:
        self.health = health
        self.every = max(1, every)

    def record(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int) or "eval_loss" in record:
            return
        if step % self.every and ("loss" not in record or record["loss"] is not None):
            return  # not a logged step, and its loss is finite (metrics.jsonl writes NaN and inf as null)
        seen = dict(record)
        data_ms, step_s = record.get("data_ms"), record.get("step_time_s")
        if isinstance(data_ms, int | float) and isinstance(step_s, int | float) and step_s > 0:
            seen["data_share"] = min(1.0, data_ms / 1000 / step_s)
        if "loss" in record or "data_share" in seen or "memory_bytes" in record:
            self.health.observe(step, seen)

    def close(self) -> None:
        """Write what health.json does not hold yet (a change that came within 10 s of the last write)."""
        self.health.close()
