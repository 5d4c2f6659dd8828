"""The watchdog's stack dumps (``logs/stacks-rank-N.txt``): which frames mean "waiting in a collective".

The watchdog on the ranks and the failure classes on the login node read the same dumps for the same question,
whether a rank's main thread is inside torch.distributed / DeepSpeed communication; the answer is defined here.
A dump starts with ``# rank N ...`` and names its main thread (``# main thread 0x...``) before faulthandler's
``Thread 0x...`` sections.
"""

from __future__ import annotations

import re

__all__ = ["COLLECTIVE_FRAMES", "DUMP_SEPARATOR", "in_collective", "main_thread_frames"]

COLLECTIVE_FRAMES = ("torch/distributed/", "deepspeed/comm/", "deepspeed/runtime/comm/")
DUMP_SEPARATOR = "\n# rank "  # every dump's header starts a line with "# rank N on HOST"
_MAIN = re.compile(r"^# main thread (0x[0-9a-f]+)$", re.MULTILINE)


def main_thread_frames(dump: str) -> list[str]:
    """The frames of the rank's main thread (named in the dump's header), innermost first; [] without a header."""
    match = _MAIN.search(dump)
    if match is None:
        return []
    frames: list[str] = []
    inside = False
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = match[1] in line.split()
            continue
        if inside and line.strip().startswith("File"):
            frames.append(line.strip())
    return frames


def in_collective(dump: str) -> bool:
    """Whether the main thread of the last dump in ``dump`` waits inside a collective (without a main-thread
    header, the frames before the first thread section count)."""
    last = dump.rsplit(DUMP_SEPARATOR, 1)[-1]
    main = _MAIN.search(last)
    frames: list[str] = []
    inside = main is None
    for line in last.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = main is not None and main[1] in line.split()
        elif inside and line.strip().startswith("File"):
            frames.append(line)
    return any(marker in frame for frame in frames for marker in COLLECTIVE_FRAMES)
