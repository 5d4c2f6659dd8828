"""``python -m hpc_train.login.doctor.probe_task DIR SIGNAL [CODE_PATH]``: one task of doctor's signal-delivery
probe job.

Every task installs a handler for SIGNAL first (as a training rank does, so an early signal is kept), reads the
token doctor wrote into DIR, and reports ``DIR/ready-<procid>.json``. When the signal arrives it reports
``DIR/signal-<procid>.json`` and exits 0. Standard library only: this must start in a blink on any node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

WAIT_LIMIT_S = 3600.0  # the job's --time ends it first; this is only a backstop for runs outside Slurm
_POLL_S = 0.05


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Temporary name, then rename: doctor never reads half a report."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(descriptor, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def _read_token(folder: Path) -> str | None:
    try:
        return (folder / "token").read_text(encoding="utf-8").strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m hpc_train.login.doctor.probe_task DIR SIGNAL [CODE_PATH]", file=sys.stderr)
        return 2
    folder, name = Path(args[0]), args[1].upper().removeprefix("SIG")
    signum = getattr(signal, f"SIG{name}", None)
    if not isinstance(signum, signal.Signals):
        print(f"hpc_train doctor probe: unknown signal {args[1]!r}", file=sys.stderr)
        return 2
    received: list[float] = []
    signal.signal(signum, lambda _signum, _frame: received.append(time.time()))  # only a flag, as in training
    rank = os.environ.get("SLURM_PROCID", "0")
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    about = {"rank": int(rank) if (rank.isascii() and rank.isdigit()) else rank, "node": node,
             "hostname": socket.gethostname(), "pid": os.getpid(), "job_id": os.environ.get("SLURM_JOB_ID", "")}
    if len(args) == 3:  # the user program's file: compute nodes must see it as they see the run folder
        about["code_seen"] = Path(args[2]).exists()
    if not folder.is_dir():  # nothing is created on a node that does not share the folder
        print(f"hpc_train doctor probe: rank {rank} on {node}: {folder} does not exist here: the run folder root "
              "is not shared with this node", file=sys.stderr)
        return 4
    token = _read_token(folder)
    if token is None:
        print(f"hpc_train doctor probe: rank {rank} on {node} cannot read {folder}/token", file=sys.stderr)
    _write_json(folder / f"ready-{rank}.json", {**about, "token": token, "signal": name, "ready": time.time()})
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not received and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if not received:
        print(f"hpc_train doctor probe: rank {rank} on {node} got no SIG{name} in {WAIT_LIMIT_S:.0f} s",
              file=sys.stderr)
        return 3
    _write_json(folder / f"signal-{rank}.json", {**about, "signal": f"SIG{name}", "received": received[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
