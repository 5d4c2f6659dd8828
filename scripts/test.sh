#!/usr/bin/env bash
# Run every test: lint, then pytest. Installs what it needs first (scripts/bootstrap.sh). As root it also
# installs Open MPI and brings up the local Slurm cluster (scripts/local_slurm.sh) for the end-to-end tests,
# which then must run rather than skip, and takes the cluster down afterwards if it started it.
# Extra arguments go to pytest, e.g. scripts/test.sh -k render
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh

if [ "$(id -u)" = 0 ]; then
    if ! command -v mpirun >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq openmpi-bin >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq openmpi-bin >/dev/null; }
    fi
    if ! command -v strace >/dev/null; then  # tests/rank/runtime/test_run_folder_ops.py traces the ranks with it
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq strace >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq strace >/dev/null; }
    fi
    if ! scripts/local_slurm.sh status >/dev/null 2>&1; then
        trap 'scripts/local_slurm.sh down' EXIT
    fi
    scripts/local_slurm.sh up
    export HPC_TRAIN_REQUIRE_SLURM=1
fi

# DeepSpeed's CPU shm all-reduce buffers (66 MB of RAM each) that runs before hpc_train.rank.train.dscomm leaked
# would crowd out the tests' memory; an hour-old one belongs to no live test run.
find /dev/shm -maxdepth 1 -name 'deepspeed_allreduce_buffer_*' -mmin +60 -delete 2>/dev/null || true

.venv/bin/ruff check .  # every Python file of the repository (hpc_train, tests, benchmarks) but .venv
# Bytecode for the repository's own modules, written once here: where PYTHONDONTWRITEBYTECODE is set (this
# machine's environment sets it) a process that finds none compiles the module from source and writes nothing, so
# the suite's thousands of processes (a CLI call, a rank) compiled again what no earlier one had left.
.venv/bin/python -m compileall -q -j 0 hpc_train tests benchmarks examples >/dev/null
# Two lanes (pytest-xdist): every test that uses the local Slurm cluster in one, one at a time; every other test
# file in the other lanes, a file at a time (tests/conftest.py). Most of a lane's time is waiting on Slurm, on
# process start-up and on sleeps, so two lanes on two cores finish in about two thirds of one lane's time.
# HPC_TRAIN_TEST_LANES=1 runs everything in one lane.
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${HPC_TRAIN_TEST_LANES:-2}" --dist loadgroup --durations=15 "$@"
