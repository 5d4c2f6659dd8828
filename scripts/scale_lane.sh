#!/usr/bin/env bash
# The scale lane (issue 38; not part of scripts/test.sh, which must stay under 30 minutes): grow the local Slurm
# cluster to 64 nodes and a hot spare (65 slurmd on this machine, Slurm's multiple-slurmd setup), run
# tests/scale (hpc_train's agents and coordinator over lightweight ranks: start, a restart in place, a spare taking
# a lost node), then bring the cluster back to its usual 3 nodes. As root, like scripts/local_slurm.sh up.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
trap 'scripts/local_slurm.sh up >/dev/null' EXIT  # the usual 3 nodes again, whatever happened
scripts/local_slurm.sh up --nodes "${HPC_TRAIN_SCALE_NODES:-65}"
HPC_TRAIN_REQUIRE_SLURM=1 .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/scale "$@"
