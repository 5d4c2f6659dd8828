"""Every exit status of the run protocol, defined once: the ranks exit with these and the login side reads them.

A rank's exit status is the one word that survives a job Slurm has already cleaned up: sacct keeps it, and
``hpc_train.login.ops`` classifies the attempt by it. Writer and reader therefore share these names.
"""

from __future__ import annotations

__all__ = ["COMMAND_NOT_RUNNABLE", "EXIT_HUNG", "EXIT_NOT_RETRIED", "EXIT_RESTART_IN_PLACE", "EXIT_SAVE_HUNG",
           "EXIT_STOPPED", "LOCAL_REQUEUE_EXIT"]

EXIT_STOPPED = 75  # EX_TEMPFAIL: saved and stopped on a signal, not requeued; run the same command to go on
EXIT_SAVE_HUNG = 76  # the force-exit timer ended a save that did not finish within the lead time
EXIT_HUNG = 77  # the watchdog ended a rank that made no progress; the stacks are in logs/stacks-rank-N.txt
EXIT_NOT_RETRIED = 78  # a failure the retry policy does not retry (again); the reason is in rank 0's log
EXIT_RESTART_IN_PLACE = 79  # a rank asks its agent (hpc_train.rank.agent) to start the ranks again in the same job
LOCAL_REQUEUE_EXIT = 144  # submitit's LocalExecutor restarts the job's tasks when one exits with this
COMMAND_NOT_RUNNABLE = frozenset({126, 127})  # the shell's "not executable" / "command not found"
