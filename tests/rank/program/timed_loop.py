"""A user function that times its own sections with ``ctx.timer`` (tests/rank/program/test_timer.py)."""

from __future__ import annotations

import time
from pathlib import Path


def main(ctx) -> None:
    try:
        with ctx.timer("bad name"):
            pass
    except ValueError as error:
        Path(ctx.params["out"]).write_text(str(error))
    for step in range(1, 7):
        with ctx.timer("load"):
            time.sleep(0.02)
        with ctx.timer("compute"):
            time.sleep(0.005)
        with ctx.timer("compute"):  # a section timed twice in a step adds up
            time.sleep(0.005)
        if step % 2 == 0:  # a record every other step holds both steps' time
            ctx.log(step, loss=1.0 / step)
