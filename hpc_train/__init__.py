"""hpc_train: distributed DeepSpeed training on Slurm, from a login node in one command.

The login-node side (config, plan, render, submit) never imports torch or deepspeed.
"""

__version__ = "0.1.0"
