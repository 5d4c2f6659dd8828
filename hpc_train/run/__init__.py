"""The run folder's protocol: the one place that says what a run folder holds and how its files are written.

A low room: the modules here import only the standard library, :mod:`hpc_train.errors` and the pure-stdlib
:mod:`hpc_train.common.hostlist`, never the config, the trainer, Slurm, torch or numpy. Both sides of the
protocol use them: the ranks that write the run folder and the login-node commands that read it.
"""
