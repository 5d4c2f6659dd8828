"""Pure helpers both sides use: Slurm host lists (``hostlist``), which rank sits where on the tensor, context,
data and pipeline axes (``topology``), and text made safe to show (``terminal``). Standard library only."""
