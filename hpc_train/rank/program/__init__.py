"""Your own program on every rank: a function called with a :class:`RunContext`, or a torchrun-style script.

``hpc_train.context()`` returns the rank's context; see ``docs/your-own-code.md``.
"""
