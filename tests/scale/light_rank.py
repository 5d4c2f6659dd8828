"""A rank of the scale lane that trains nothing: it says it runs (its life, rank, node and pid) on the job's
coordinator through the address its agent gave it, then waits until the lane says finish. No torch: 64 of them and
their agents fit in a few GB."""

import os
import sys
import time

from hpc_train.control.client import ControlClient
from hpc_train.control.discovery import from_env

address = from_env(os.environ)
if address is None:
    sys.exit("no coordinator named by the agent")
life, rank = os.environ["HPC_TRAIN_IN_PLACE"], os.environ["SLURM_PROCID"]
client = ControlClient.connect(address.host, address.port, address.token, f"light-{rank}-{os.getpid()}")
client.watch("lane/finish")
client.set(f"lane/running/{life}/{rank}", {"node": os.environ.get("SLURMD_NODENAME", "?"), "pid": os.getpid(),
                                             "time": time.time()})
client.wait_for("lane/finish", 1800)
client.close()
