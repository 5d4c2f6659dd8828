"""``python -m hpc_train plot RUN_DIR [RUN_DIR ...]``: a picture of runs for someone on a login node without a
port to forward: loss and eval loss, lr, tokens/s and the step breakdown against step, one colour per run, every
attempt's start and every preemption, requeue or failure marked (:mod:`hpc_train.login.ops.plot_data`).

matplotlib comes with the ``plot`` extra (the quick start's bootstrap installs it) and is imported only here, with
the non-interactive Agg backend: nothing opens a window, no torch is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train.errors import ConfigError
from hpc_train.login.ops.plot_data import DEFAULT_PANELS, RunSeries
from hpc_train.run.outputs import check_output, open_output

__all__ = ["FORMATS", "check_plot_out", "choose_panels", "draw"]

FORMATS = (".png", ".svg", ".pdf")
_MARK_STYLE = {"start": ("tab:green", ":"), "preempted": ("tab:orange", "--"), "failed": ("tab:red", "-"),
               "hang": ("tab:purple", "-"), "killed": ("tab:red", "--"), "node_failure": ("tab:brown", "-"),
               "infrastructure": ("tab:brown", "--")}


def choose_panels(runs: list[RunSeries], metrics: list[str] | None) -> list[tuple[str, ...]]:
    """The panels to draw: each ``--metric`` alone, or the default panels the runs logged; ConfigError naming
    the metrics there are when one asked for is in no run."""
    logged = sorted({name for run in runs for name in run.series})
    if metrics:
        unknown = [name for name in metrics if name not in logged]
        if unknown:
            raise ConfigError("--metric", f"{', '.join(unknown)} is in no run's metrics.jsonl",
                              f"pick from: {', '.join(logged)}")
        return [(name,) for name in metrics]
    panels = [tuple(n for n in panel if n in logged) for panel in DEFAULT_PANELS]
    panels = [panel for panel in panels if panel]
    return panels or [(name,) for name in logged[:4]]


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plot", "needs matplotlib, which is not installed",
                          "pip install 'hpc_train[plot]' (scripts/bootstrap.sh installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_out(out: Path) -> Path:
    """``out`` as a picture's path: a .png, .svg or .pdf name that :func:`check_output` accepts (a regular file
    or a new name in an existing folder; never a FIFO, which hung the command, a device, a link or a folder)."""
    if out.suffix.lower() not in FORMATS:
        raise ConfigError("--out", f"{out} is not one of {', '.join(FORMATS)}", "name a .png, .svg or .pdf file")
    return check_output(out, example="plot.png")


def _label(panel: tuple[str, ...]) -> str:
    """A panel's y-axis label, short enough for the panel's height (the legend names each line): five step
    shares joined by " / " ran past the bottom panel and were clipped."""
    if len(panel) <= 2:
        return " / ".join(panel)
    return "share of the step" if all(name.endswith("_share") for name in panel) else "\n".join(panel)


def draw(runs: list[RunSeries], panels: list[tuple[str, ...]], out: Path) -> None:
    """One figure, a panel per row, every run in its own colour, the attempt marks on every panel, written
    through :func:`open_output` (matplotlib never opens ``out`` itself: the format is named, not guessed)."""
    check_plot_out(out)
    plt = _matplotlib()
    figure, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(10, 2.6 * len(panels) + 0.6), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, panel in zip(axes[:, 0], panels, strict=True):
        for index, run in enumerate(runs):
            colour = colours[index % len(colours)]
            for style, name in zip(("-", "--", "-.", ":", (0, (1, 3)), (0, (5, 1, 1, 1))), panel, strict=False):
                if name in run.series:
                    steps, values = run.series[name]
                    label = name if len(runs) == 1 else f"{run.name}: {name}"
                    axis.plot(steps, values, linestyle=style, color=colour, label=label, linewidth=1.2)
            for mark in run.marks:
                mark_colour, line = _MARK_STYLE.get(mark.kind, ("tab:gray", ":"))
                axis.axvline(mark.step, color=mark_colour, linestyle=line, linewidth=1, alpha=0.8)
        axis.set_ylabel(_label(panel), fontsize=8)
        axis.grid(alpha=0.3)
        # beside the panel, never over its lines; savefig's tight box keeps it and every label in the picture
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    top = axes[0, 0]
    for run in runs:
        for mark in run.marks:
            top.annotate(mark.label, (mark.step, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                         va="top", ha="right", color=_MARK_STYLE.get(mark.kind, ("tab:gray", ""))[0])
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(", ".join(run.name for run in runs), fontsize=10)
    figure.tight_layout()
    try:
        with open_output(out) as handle:
            figure.savefig(handle, format=out.suffix.lower()[1:], dpi=110, bbox_inches="tight")
    finally:
        plt.close(figure)
