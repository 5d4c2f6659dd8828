"""``--sweep KEY=V1,V2,...``: one config, many runs; the product of all sweeps, each with its own run folder."""

from __future__ import annotations

import itertools

from hpc_train.errors import ConfigError

__all__ = ["MAX_SWEEP_RUNS", "expand_sweeps", "sweep_name"]

# One job array; Slurm's MaxArraySize is 1001 by default, and each run is a run folder and a plan validated here.
MAX_SWEEP_RUNS = 1000


def sweep_name(base: str, index: int) -> str:
    """Run names of a sweep: base-000, base-001, ... (stable, so a resubmitted sweep resumes its runs)."""
    return f"{base}-{index:03d}"


def expand_sweeps(sweeps: list[str]) -> list[list[str]]:
    """Each combination as a list of ``--set`` overrides, in the order the values were given."""
    axes = []
    runs = 1
    for text in sweeps:
        key, sep, values = text.partition("=")
        key = key.strip()  # checked as the override will read it: " job.partition" is job.partition
        if not sep or "." not in key or not values:
            raise ConfigError(f"--sweep {text}", "expected SECTION.KEY=V1,V2,...", "write it like "
                              "--sweep train.lr=1e-3,3e-4")
        if key.split(".")[0].strip().lower() in ("job", "env", "preempt"):
            raise ConfigError(f"--sweep {text}", "the runs of a sweep are one job array and share its resources, "
                              "environment and signal handling", "sweep train, zero, parallel, dist, data, "
                              "checkpoint or monitor keys; submit job.*, env.* and preempt.* variants separately")
        items = [value.strip() for value in values.split(",")]
        if any(not item for item in items) or len(set(items)) != len(items):
            raise ConfigError(f"--sweep {text}", "has an empty or repeated value", "list distinct values")
        runs *= len(items)
        if runs > MAX_SWEEP_RUNS:
            raise ConfigError(f"--sweep {text[:80]}", f"the sweeps make more than {MAX_SWEEP_RUNS:,} runs",
                              "sweep fewer values at a time (a job array this large is refused by most sites)")
        axes.append([f"{key}={item}" for item in items])
    return [list(combo) for combo in itertools.product(*axes)]
