"""One agent per node: it starts the node's ranks, watches them, and starts them again inside the job
(``agent``); its place from Slurm's variables and the plan (``setup``); hot spares and ``retry.shrink``
(``spares``); its one connection to the job's coordinator (``link``)."""
