"""Operating long runs from a login node: failure classes, the retry policy and node exclusion, the merged rank
logs and the live status view. Read-only over the run folder (except ``excluded_nodes.json``, which the requeue
path writes); never imports torch or DeepSpeed, so every command here answers at once."""
