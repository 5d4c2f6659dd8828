"""A stand-in rank for tests/rank/agent/test_standby.py: prints where and how it runs, as one JSON line."""

import json
import os
import sys
from pathlib import Path

threads = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "procid": os.environ.get("SLURM_PROCID"),
                  "only_standby": os.environ.get("HPC_TRAIN_TEST_STANDBY_ONLY"), "torch": "torch" in sys.modules,
                  "threads": threads, "name": __name__,
                  "oom_score_adj": Path("/proc/self/oom_score_adj").read_text().strip()}), flush=True)
