"""What a training run tells people while it runs and leaves behind after: progress lines, ``metrics.jsonl``
and TensorBoard events, all from rank 0 only.

Why one object: the trainer calls ``monitor.step(...)`` every step on every rank and never asks "am I rank 0"
or "is this a log step"; ``Monitor.create`` hands other ranks a :class:`NullMonitor` whose methods do nothing,
so there is one code path and no rank can write a second copy of a file.

Why the resume handling: a Slurm job that is requeued (preemption, node failure) restarts from its last
checkpoint at ``start_step`` while the run folder still holds metrics for the steps after it. Those steps
will be trained again, so on construction ``metrics.jsonl`` is rewritten without them (temp file + rename,
so a crash cannot leave half a file) and TensorBoard is given ``purge_step=start_step + 1``, which makes its
reader drop the stale events. Every line is flushed as it is written, so ``tail -f`` and a crash both see
whole records.

Throughput and ETA are averaged over all the steps since the previous log line, not taken from the one step
that happens to be logged (which may hold a checkpoint save or an eval). Loss, lr and grad norm are those of
the logged step; they are only read on logged steps, so passing a device tensor costs a sync only there.

TensorBoard needs the ``tensorboard`` package (``torch.utils.tensorboard`` imports it); it is imported only
when ``tensorboard=True``, so this module itself needs neither torch nor tensorboard. How its events are written
(one event a logged step, the file opened once) is :mod:`hpc_train.rank.runtime.tensorboard_events`.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, SupportsFloat

from rich.console import Console
from rich.markup import escape

from hpc_train.rank.runtime.flops import mfu as _mfu
from hpc_train.rank.runtime.metric_lines import frozen_value, json_number, record_line
from hpc_train.rank.runtime.tensorboard_events import TENSORBOARD_DIR, open_writer, write_scalars
from hpc_train.run.paths import METRICS_FILE
from hpc_train.run.quick_exit import on_leave

__all__ = ["TENSORBOARD_DIR", "LogLines", "Monitor", "NullMonitor", "format_duration", "truncate_metrics"]


class LogLines(io.TextIOBase):
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


def format_duration(seconds: float) -> str:
    """``3723.4`` -> ``"1:02:03"``; a day or more as ``"2d 03:04:05"``; unknown (inf/nan) as ``"?"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}"


def truncate_metrics(path: Path, start_step: int) -> int:
    """Rewrite ``path`` keeping only records with ``step <= start_step``; return how many were dropped.

    Lines that are not a JSON object with an integer ``step`` are dropped too: the only way to get one is a
    write cut short by a crash, and appending after a torn line would glue the next record onto it. The new
    file is written beside the old one and renamed over it, so readers see the old or the new file, whole.
    """
    if not path.exists():
        return 0
    kept: list[str] = []
    dropped = 0
    unterminated = False  # a whole record whose newline was lost: keep it, but rewrite to end the line
    with path.open(encoding="utf-8") as old:
        for line in old:
            unterminated = not line.endswith("\n")
            try:
                record = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool) and step <= start_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped == 0 and not unterminated:
        return 0
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as new:
            new.writelines(kept)
            new.flush()
            os.fsync(new.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    return dropped


def _float(value: SupportsFloat | None) -> float | None:
    """A plain float (reads a tensor's value), or None."""
    return None if value is None else float(value)


class Monitor:
    """Rank 0's progress lines, ``run_dir/metrics.jsonl`` and ``run_dir/tensorboard/`` for one run.

    Build it with :meth:`create` on every rank. ``step`` numbers are optimizer steps counted from 1 (step
    ``s`` is the ``s``-th completed step); a run resumed from a checkpoint taken after step ``start_step``
    continues with ``start_step + 1``. Records with a larger step already in the run folder are discarded on
    construction (with ``start_step=0`` too: a job requeued before its first checkpoint starts over).

    ``tokens`` passed to :meth:`step` and ``peak_flops`` must cover the same devices: either this rank's
    tokens with one device's peak, or the whole job's tokens with ``peak * world_size``. The MFU written is
    a fraction (0.42 = 42 %); with an infinite peak (unknown device, CPU) it is 0.
    """

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        log_every: int = 10,
        tensorboard: bool = True,
        histogram_every: int = 0,
        flops_per_token: float = 0.0,
        peak_flops: float = math.inf,
        start_step: int = 0,
        console: Console | None = None,
        exporters: Sequence[Any] = (),
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if histogram_every < 0:
            raise ValueError(f"histogram_every must be >= 0 (0 = never), got {histogram_every}")
        if start_step < 0 or total_steps < 0:
            raise ValueError(f"steps must be >= 0, got start_step={start_step}, total_steps={total_steps}")
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.log_every = log_every
        self.tensorboard = tensorboard
        self.histogram_every = histogram_every
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.start_step = start_step
        self.console = console if console is not None else Console()
        self._window_steps = 0
        self._window_tokens = 0.0
        self._window_seconds = 0.0
        self._last_scalars: tuple[int, float] | None = None
        self._closed = False
        self.exporters = list(exporters)  # hpc_train.rank.runtime.exporters: each gets every record
        self._pending: list[tuple[int, float, dict[str, Any]]] = []  # ctx.log's records, until the next flush
        self._off_leave: Callable[[], None] | None = None

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        truncate_metrics(self.metrics_path, start_step)
        self._metrics: IO[str] | None = self.metrics_path.open("a", encoding="utf-8")
        self._writer: Any = None
        if tensorboard:
            try:
                self._writer = open_writer(self.run_dir, start_step)
            except ImportError as error:
                self._metrics.close()
                raise ImportError("Monitor(tensorboard=True) needs the tensorboard package: pip install tensorboard "
                                  "(or turn TensorBoard off)") from error
            self._off_leave = on_leave(self._flush_files)  # a quick exit writes what the writer holds

    @classmethod
    def create(cls, rank: int, run_dir: Path, total_steps: int, log_every: int = 10, tensorboard: bool = True,
               histogram_every: int = 0, flops_per_token: float = 0.0, peak_flops: float = math.inf,
               start_step: int = 0, console: Console | None = None,
               exporters: Callable[[], Sequence[Any]] | None = None) -> Monitor:
        """The monitor for global ``rank``: a real one on rank 0, a :class:`NullMonitor` everywhere else.
        ``exporters`` builds rank 0's exporters (W&B, Prometheus); other ranks never call it."""
        if rank != 0:
            return NullMonitor(total_steps=total_steps, log_every=log_every, tensorboard=tensorboard,
                               histogram_every=histogram_every)
        return cls(run_dir, total_steps, log_every=log_every, tensorboard=tensorboard,
                   histogram_every=histogram_every, flops_per_token=flops_per_token, peak_flops=peak_flops,
                   start_step=start_step, console=console, exporters=exporters() if exporters else ())

    # -- when things happen (the same answer on every rank, NullMonitor included) ---------------------------

    def log_due(self, step: int) -> bool:
        """Whether :meth:`step` prints and records at ``step``: every ``log_every`` steps and the last one."""
        return step % self.log_every == 0 or step == self.total_steps

    def histograms_due(self, step: int) -> bool:
        """Whether :meth:`histograms` writes at ``step``. The same on every rank, so a trainer can gather
        sharded (ZeRO-3) parameters, a collective, only on these steps and on all ranks."""
        return self.tensorboard and self.histogram_every > 0 and step % self.histogram_every == 0

    # -- recording ----------------------------------------------------------------------------------------

    def step(self, step: int, loss: SupportsFloat, lr: SupportsFloat, grad_norm: SupportsFloat | None,
             tokens: float, step_time_s: float, memory_bytes: int | None = None,
             breakdown: Mapping[str, float] | None = None) -> None:
        """Account one optimizer step; on log steps print a line, append to metrics.jsonl, write scalars.

        ``tokens``: tokens this step processed (see the class note on which devices); ``step_time_s``: its
        wall time. ``loss``, ``lr``, ``grad_norm`` may be tensors: they are only read on log steps.
        ``memory_bytes``: e.g. ``torch.cuda.max_memory_allocated()``; None leaves it out. ``breakdown``: the
        step-time breakdown of a log step (:mod:`hpc_train.rank.train.breakdown`), into the record, TensorBoard
        (``breakdown/...``) and the line's shares.
        """
        self._window_steps += 1
        self._window_tokens += tokens
        self._window_seconds += step_time_s
        if not self.log_due(step):
            return
        seconds = self._window_seconds
        mean_step = seconds / self._window_steps
        tokens_per_s = self._window_tokens / seconds if seconds > 0 else 0.0
        utilisation = _mfu(tokens_per_s, self.flops_per_token, self.peak_flops)
        eta = max(self.total_steps - step, 0) * mean_step
        self._window_steps, self._window_tokens, self._window_seconds = 0, 0.0, 0.0

        loss_f, lr_f, grad_f = float(loss), float(lr), _float(grad_norm)
        self._append({
            "step": step,
            "loss": json_number(loss_f),
            "lr": json_number(lr_f),
            "grad_norm": json_number(grad_f),
            "tokens_per_s": tokens_per_s,
            "mfu": utilisation,
            "step_time_s": mean_step,
            "memory_bytes": memory_bytes,
            **(breakdown or {}),
            "time": time.time(),
        })
        if self._writer is not None:
            scalars = {
                "train/loss": loss_f, "train/lr": lr_f, "train/grad_norm": grad_f,
                "perf/tokens_per_s": tokens_per_s, "perf/mfu": utilisation, "perf/step_time_s": mean_step,
                "perf/memory_bytes": None if memory_bytes is None else float(memory_bytes),
            }
            scalars.update({f"breakdown/{name}": value for name, value in (breakdown or {}).items()})
            write_scalars(self._writer, scalars, step)
        self._print_step(step, loss_f, lr_f, grad_f, tokens_per_s, utilisation, memory_bytes, eta, breakdown)

    def scalars(self, step: int, values: Mapping[str, SupportsFloat]) -> None:
        """A user program's ``ctx.log(step, **values)``: a metrics.jsonl record (with the mean step time since the
        previous one) every call, written in batches; TensorBoard scalars and the progress line on
        :meth:`log_due` steps only. Non-finite values are written as null.

        Why batches: writing each record as it comes cost 16 us a call (JSON, a write and a flush), and TensorBoard
        about 0.1 ms of CPU a scalar. A call now only keeps the values (a tensor detached and copied, so a later
        in-place update cannot change what was logged, and nothing is read back from a GPU on the step); the
        records are written at the log interval, by :meth:`close` and before any stop leaves the process
        (``quick_exit.on_leave``). A writer thread was measured too: on CPU-bound loops it cost more than this
        (each op that releases the GIL handed it to the writer), so there is none."""
        kept = {}
        for name, value in values.items():
            if type(value) is float:  # the common case first: no checks to make, nothing to copy
                kept[name] = value
                continue
            if not (isinstance(value, int | float) or hasattr(value, "__float__")) or isinstance(value, bool | str):
                raise TypeError(f"ctx.log({name}={value!r}): a logged value is a number or a one-element tensor")
            kept[name] = frozen_value(value)
        if self._off_leave is None:
            self._off_leave = on_leave(self._flush_files)
        self._pending.append((step, time.time(), kept))
        if step % self.log_every == 0 or step == self.total_steps:  # log_due, inline: this runs every step
            self.flush()

    def flush(self) -> None:
        """Write the records :meth:`scalars` keeps, then TensorBoard and the progress line of the last one."""
        pending, self._pending = self._pending, []
        if not pending or self._metrics is None:
            return
        lines = []
        record: dict[str, Any] = {}
        for step, now, values in pending:
            record = {"step": step}
            for name, value in values.items():
                number = float(value)
                record[name] = number if math.isfinite(number) else None  # _json_number, inline
            last = self._last_scalars
            if last is not None and step > last[0] and now > last[1]:
                record["step_time_s"] = (now - last[1]) / (step - last[0])
            record["time"] = now
            self._last_scalars = (step, now)
            lines.append(record_line(record))
            for exporter in self.exporters:
                exporter.record(record)
        self._metrics.write("".join(lines))
        self._metrics.flush()
        step = record["step"]
        if not self.log_due(step):
            return  # a flush at close or at a stop: the records only
        if self._writer is not None:
            write_scalars(self._writer, {f"train/{name}": value for name, value in record.items()
                                         if name not in ("step", "time")}, step)
        total = f"/{self.total_steps}" if self.total_steps else ""
        shown = " ".join(f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value}"
                         for name, value in record.items() if name not in ("step", "time"))
        self._plain(f"step={step}{total} {shown}".rstrip())

    def eval(self, step: int, loss: SupportsFloat) -> None:
        """Record an evaluation loss at ``step``: a line, ``{"step", "eval_loss"}`` in metrics.jsonl, eval/loss."""
        loss_f = float(loss)
        self._append({"step": step, "eval_loss": json_number(loss_f)})
        if self._writer is not None:
            self._writer.add_scalar("eval/loss", loss_f, step)
        ppl = math.exp(loss_f) if loss_f < 700 else math.inf
        if self.console.is_terminal:
            self.console.print(f"[bold magenta]eval[/] step {step}/{self.total_steps}  "
                               f"loss [bold]{loss_f:.4f}[/]  ppl {ppl:.2f}", highlight=False)
        else:
            self._plain(f"eval step={step}/{self.total_steps} eval_loss={loss_f:.4f} ppl={ppl:.2f}")

    def histograms(self, step: int, named_parameters: Iterable[tuple[str, Any]]) -> None:
        """Weight histograms (``weights/<name>``) when :meth:`histograms_due`; otherwise nothing.

        ``named_parameters`` is e.g. ``model.named_parameters()``; it is not iterated on other steps. Under
        ZeRO-3 each rank holds only a shard: gather first (on all ranks) or the histograms show rank 0's
        shard. Empty tensors are skipped.
        """
        if self._writer is None or not self.histograms_due(step):
            return
        for name, param in named_parameters:
            if param.numel() == 0:
                continue
            self._writer.add_histogram(f"weights/{name}", param.detach().float().cpu(), step)

    def _flush_files(self) -> None:
        """What a quick exit runs: the records :meth:`scalars` keeps, and what the TensorBoard writer holds."""
        self.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close metrics.jsonl and the TensorBoard writer; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self.flush()  # what ctx.log kept, before the files close
        if self._off_leave is not None:
            self._off_leave()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for exporter in self.exporters:
            exporter.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- output -------------------------------------------------------------------------------------------

    def _append(self, record: dict[str, Any]) -> None:
        if self._metrics is None:
            raise RuntimeError("Monitor is closed")
        self._metrics.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics.flush()
        for exporter in self.exporters:
            exporter.record(record)

    def _plain(self, line: str) -> None:
        """One unwrapped line for logs (rich would wrap at 80 columns when stdout is not a terminal)."""
        out = self.console.file
        out.write(line + "\n")
        out.flush()

    def _print_step(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens_per_s: float,
                    utilisation: float, memory_bytes: int | None, eta: float,
                    breakdown: Mapping[str, float] | None = None) -> None:
        total = self.total_steps
        done = 100.0 * step / total if total else 100.0
        grad = "-" if grad_norm is None else f"{grad_norm:.3f}"
        mfu_text = f"{100 * utilisation:.1f}%" if math.isfinite(self.peak_flops) else "n/a"
        memory = None if memory_bytes is None else memory_bytes / 2**30
        if self.console.is_terminal:
            parts = [
                f"[bold cyan]step {step:>{len(str(total))}}/{total}[/] [dim]({done:5.1f}%)[/]",
                f"loss [bold]{loss:.4f}[/]",
                f"lr {lr:.2e}",
                f"gnorm {escape(grad)}",
                f"[green]{tokens_per_s:,.0f} tok/s[/]",
                f"MFU [yellow]{mfu_text}[/]",
            ]
            if memory is not None:
                parts.append(f"mem {memory:.1f} GiB")
            if breakdown:
                parts.append("[dim]" + " ".join(f"{word} {share}" for word, share in _shares(breakdown)) + "[/]")
            parts.append(f"ETA [bold]{format_duration(eta)}[/]")
            self.console.print("  ".join(parts), highlight=False)
        else:
            fields = [f"step={step}/{total}", f"loss={loss:.4f}", f"lr={lr:.3e}", f"grad_norm={grad}",
                      f"tokens_per_s={tokens_per_s:.0f}", f"mfu={mfu_text}"]
            if memory is not None:
                fields.append(f"mem_gib={memory:.2f}")
            if breakdown:
                fields += [f"{word}={share}" for word, share in _shares(breakdown)]
            fields.append(f"eta={format_duration(eta)}")
            self._plain(" ".join(fields))


def _shares(breakdown: Mapping[str, float]) -> list[tuple[str, str]]:
    """``[("data", "12%"), ("fwd", "30%"), ...]``: the breakdown's shares of the step, for the progress line."""
    short = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "comm": "comm"}
    return [(word, f"{100 * breakdown[f'{name}_share']:.0f}%") for name, word in short.items()
            if f"{name}_share" in breakdown]


class NullMonitor(Monitor):
    """What ranks other than 0 get: the same interface, no files, no output.

    It keeps the schedule (``log_every``, ``histogram_every``, ``tensorboard``) so :meth:`log_due` and
    :meth:`histograms_due` agree with rank 0 and collective work tied to them stays in step across ranks.
    """

    def __init__(self, total_steps: int = 0, log_every: int = 10, tensorboard: bool = True,
                 histogram_every: int = 0) -> None:
        self.total_steps = total_steps
        self.log_every = max(log_every, 1)
        self.tensorboard = tensorboard
        self.histogram_every = histogram_every
        self._closed = True

    def step(self, step: int, loss: SupportsFloat, lr: SupportsFloat, grad_norm: SupportsFloat | None,
             tokens: float, step_time_s: float, memory_bytes: int | None = None,
             breakdown: Mapping[str, float] | None = None) -> None:
        """Nothing (not rank 0)."""

    def scalars(self, step: int, values: Mapping[str, SupportsFloat]) -> None:
        """Nothing (not rank 0)."""

    def flush(self) -> None:
        """Nothing (not rank 0)."""

    def eval(self, step: int, loss: SupportsFloat) -> None:
        """Nothing (not rank 0)."""

    def histograms(self, step: int, named_parameters: Iterable[tuple[str, Any]]) -> None:
        """Nothing (not rank 0); ``named_parameters`` is not iterated."""

    def close(self) -> None:
        """Nothing to close."""
