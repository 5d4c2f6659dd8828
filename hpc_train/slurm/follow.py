"""Follow a submitted job until it ends: its state, the tail of the rank-0 log, and a clear verdict."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["LogTail", "follow"]


class LogTail:
    """New lines of a growing file, read from where the last call stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                handle.seek(self.offset)
                text = handle.read()
                self.offset = handle.tell()
        except FileNotFoundError:
            return []
        return text.splitlines()


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def follow(job: Any, run_dir: Path, console: Console, poll_s: float = 0.5, max_poll_s: float = 5.0) -> int:
    """Poll until done (the interval backs off while nothing changes); 0 when every rank succeeded, else 1."""
    tail = LogTail(run_dir / "logs" / "rank-0.log")
    state = ""
    delay = poll_s
    while True:
        done = job.done()
        new_state = job.state
        lines = tail.new_lines()
        for line in lines:
            console.out(f"rank0 | {line}", highlight=False)
        if new_state != state:
            console.print(f"[bold]job {job.job_id}[/]: {new_state}")
            state = new_state
        if done:
            break
        delay = poll_s if lines else min(max_poll_s, delay * 1.5)
        time.sleep(delay)
    for line in tail.new_lines():
        console.out(f"rank0 | {line}", highlight=False)
    try:
        job.results()
    except Exception as error:  # a failed rank: submitit raises with the rank's error text
        console.print(f"[bold red]job {job.job_id} failed[/] ({job.state}):")
        console.out(_tail(str(error)), highlight=False)
        return 1
    console.print(f"[bold green]job {job.job_id} completed[/]; run folder: {run_dir}")
    return 0
