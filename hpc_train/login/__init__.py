"""The login side: every command a person runs on a login node (``hpc_train ...``, ``python -m
hpc_train.submit``), following a job, status, logs, plots, doctor, rendering and submitting. Nothing here imports
the rank side (:mod:`hpc_train.rank`), torch or DeepSpeed: a login node answers in about 0.2 s."""
