"""The run folder's layout, named once: every writer and every reader of a run folder uses these names.

A run folder (``RUN_ROOT/NAME``) outlives its jobs: a requeue, a resubmission or a login-node command all find
the same files by these names, so a name changed here changes it on both sides at once.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ATTEMPTS_FILE",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "DEEPSPEED_CONFIG_FILE",
    "EXCLUDED_FILE",
    "FLIGHT_RECORDER_DIR",
    "FUNCTION_FILE",
    "HEARTBEAT_DIR",
    "LOGS_DIR",
    "METRICS_FILE",
    "MODEL_FILE",
    "PLAN_FILE",
    "PROGRAM_FILE",
    "RANK_ERROR_GLOB",
    "RESULT_FILES",
    "SMOKE_FILE",
    "STACKS_GLOB",
    "SUBMITIT_DIR",
    "TRAIN_FILE",
    "VALUE_FILE",
    "control_address_path",
    "fabric_report_path",
    "follower_cancel_path",
    "hang_decision_path",
    "hang_marker_path",
    "rank_consequence_path",
    "rank_error_path",
    "recovery_claim_path",
    "restart_notice_path",
    "restart_ready_path",
    "stacks_path",
    "stop_notice_path",
    "stop_request_path",
]

PLAN_FILE = "plan.json"  # the resolved plan: what every rank reads first (plain JSON, no pickles)
CONFIG_FILE = "config.toml"  # the resolved config, for people; a changed one keeps the old as config.HASH.toml
ATTEMPTS_FILE = "attempts.jsonl"  # one line per attempt, written by rank 0 (hpc_train.run.attempts)
EXCLUDED_FILE = "excluded_nodes.json"  # nodes later attempts avoid (hpc_train.run.exclusions)
METRICS_FILE = "metrics.jsonl"  # rank 0's progress records
SMOKE_FILE = "smoke.json"  # rank 0's result of a smoke job
TRAIN_FILE = "train.json"  # rank 0's result of a training job
PROGRAM_FILE = "program.json"  # rank 0's result of a user program (a function or a script)
FUNCTION_FILE = "function.pkl"  # hpc_train.Executor.submit's function and arguments, which every rank calls
VALUE_FILE = "value.pkl"  # what that function returned on rank 0: Job.result()
RESULT_FILES = (SMOKE_FILE, TRAIN_FILE, PROGRAM_FILE)
HEALTH_FILE = "health.json"  # rank 0's health checks: the findings now and when each tripped or cleared
WANDB_DIR = "wandb"  # W&B's offline runs and logs ([monitor] wandb), for wandb sync
WANDB_STATE_FILE = "wandb.json"  # the W&B run id and the last step sent, kept across attempts
DEEPSPEED_CONFIG_FILE = "deepspeed_config.json"  # the DeepSpeed config the engine was built from, by rank 0
MODEL_FILE = "model.json"  # what export needs to know of a trained model (a Hugging Face config), by rank 0
LOGS_DIR = "logs"  # node logs (hpc_train.run.node_log), error files, stacks, fabric reports, Slurm's batch output
CHECKPOINTS_DIR = "checkpoints"
HEARTBEAT_DIR = "heartbeats"  # the ranks' and agents' notices to each other: hang markers, stops, restarts
SUBMITIT_DIR = "submitit"  # submitit's pickles and the local executor's output
FLIGHT_RECORDER_DIR = f"{LOGS_DIR}/nccl-trace"  # made with the run folder: torch writes into it, never creates it
RANK_ERROR_GLOB = "rank-*.error.json"
STACKS_GLOB = "stacks-rank-*.txt"


def rank_error_path(run_dir: Path, rank: int) -> Path:
    """Where a failing rank leaves its traceback, for the follower on the login node to report."""
    return Path(run_dir) / LOGS_DIR / f"rank-{rank}.error.json"


def rank_consequence_path(run_dir: Path, rank: int) -> Path:
    """What a rank raised after its attempt had stopped (its peers had left): a consequence, not a failure, so
    it is not a ``rank-N.error.json`` that the follower and the failure classes would read as one."""
    return Path(run_dir) / LOGS_DIR / f"rank-{rank}.consequence.json"


def stacks_path(run_dir: Path, rank: int) -> Path:
    """Where the watchdog dumps a hung rank's Python stacks (appended: one dump per hang)."""
    return Path(run_dir) / LOGS_DIR / f"stacks-rank-{rank}.txt"


def fabric_report_path(run_dir: Path, host: str) -> Path:
    """What the first rank of a node saw of its fabric, for doctor and for debugging a slow job."""
    return Path(run_dir) / LOGS_DIR / f"fabric-{host}.json"


def hang_marker_path(run_dir: Path, attempt: str) -> Path:
    """The marker the first rank to see a hang publishes; every rank's watchdog looks for it."""
    return Path(run_dir) / HEARTBEAT_DIR / f"hang-{attempt}.json"


def hang_decision_path(run_dir: Path, attempt: str) -> Path:
    """Rank 0's decision about a hang (exit status and why), which the other ranks wait for."""
    return Path(run_dir) / HEARTBEAT_DIR / f"hang-{attempt}.decided.json"


def control_address_path(run_dir: Path, attempt: str) -> Path:
    """Where the first node's agent says how to reach attempt ``attempt``'s coordinator (host, port, token; 0600)."""
    return Path(run_dir) / HEARTBEAT_DIR / f"control-{attempt}.json"


def restart_notice_path(run_dir: Path, attempt: str, in_place: int) -> Path:
    """The first word that attempt ``attempt``'s ranks start again inside the job, as in-place restart
    ``in_place`` (1, 2, ...): whoever made it first says why; every rank's agent acts on it."""
    return Path(run_dir) / HEARTBEAT_DIR / f"restart-{attempt}.{in_place}.json"


def restart_ready_path(run_dir: Path, attempt: str, in_place: int, rank: int) -> Path:
    """Made by rank ``rank``'s agent once every process of its old rank is gone; restart ``in_place`` begins
    when all ranks have one."""
    return Path(run_dir) / HEARTBEAT_DIR / f"restart-{attempt}.{in_place}.ready-{rank}"


def stop_notice_path(run_dir: Path, attempt: str) -> Path:
    """Rank 0's word that it stops attempt ``attempt`` for a program that did not ask ``should_stop()``: every
    rank leaves with the exit status it names (:mod:`hpc_train.run.stops`)."""
    return Path(run_dir) / HEARTBEAT_DIR / f"stop-{attempt}.json"


def stop_request_path(run_dir: Path, attempt: str) -> Path:
    """Another rank's word that it has the signal and the grace period is over, for a rank 0 that did not get it."""
    return Path(run_dir) / HEARTBEAT_DIR / f"stop-{attempt}.requested.json"


def recovery_claim_path(run_dir: Path, attempt: str) -> Path:
    """Made by the first rank of an attempt to fail, which alone decides whether the retry policy requeues it;
    it holds that rank's number (the follower waits for its decision)."""
    return Path(run_dir) / HEARTBEAT_DIR / f"recovery-{attempt}"


def follower_cancel_path(run_dir: Path) -> Path:
    """Why the login node's follower cancelled a job of this run (``status`` names it instead of a uid)."""
    return Path(run_dir) / LOGS_DIR / "follower-cancel.json"
