"""``python -m hpc_train doctor``: is this cluster ready for a job, checked before the job finds out the hard way.

Kept free of imports: compute-node probe tasks run ``python -m hpc_train.login.doctor.probe_task`` and must start in
a blink, and the login-node side never imports torch or DeepSpeed.
"""
